"""`python -m services.fleet`: the same as `shardline serve fleet`."""

import sys

from services.common.service_main import run_service
from services.fleet import server

sys.exit(run_service("fleet", server, sys.argv[1:], prog="python -m services.fleet"))
