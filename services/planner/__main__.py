"""`python -m services.planner`: the same as `shardline serve planner`."""

import sys

from services.cli.serve import run_service

sys.exit(run_service("planner", sys.argv[1:], prog="python -m services.planner"))
