"""`python -m services.loader`: the same as `shardline serve loader`."""

import sys

from services.cli.serve import run_service

sys.exit(run_service("loader", sys.argv[1:], prog="python -m services.loader"))
