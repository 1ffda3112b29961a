"""`python -m services.router`: the same as `shardline serve router`."""

import sys

from services.cli.serve import run_service

sys.exit(run_service("router", sys.argv[1:], prog="python -m services.router"))
