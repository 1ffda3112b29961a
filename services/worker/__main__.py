"""`python -m services.worker`: the same as `shardline serve worker`."""

import sys

from services.common.service_main import run_service
from services.worker import server

sys.exit(run_service("worker", server, sys.argv[1:], prog="python -m services.worker"))
