"""`python -m services.loader`: the same as `shardline serve loader`."""

import sys

from services.common.service_main import run_service
from services.loader import server

sys.exit(run_service("loader", server, sys.argv[1:], prog="python -m services.loader"))
