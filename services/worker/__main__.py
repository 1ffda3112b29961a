"""`python -m services.worker`: the same as `shardline serve worker`."""

import sys

from services.cli.serve import run_service

sys.exit(run_service("worker", sys.argv[1:], prog="python -m services.worker"))
