"""`python -m services.router`: the same as `shardline serve router`."""

import sys

from services.common.service_main import run_service
from services.router import server

sys.exit(run_service("router", server, sys.argv[1:], prog="python -m services.router"))
