"""`python -m services.planner`: the same as `shardline serve planner`."""

import sys

from services.common.service_main import run_service
from services.planner import server

sys.exit(run_service("planner", server, sys.argv[1:], prog="python -m services.planner"))
