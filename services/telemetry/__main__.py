"""`python -m services.telemetry`: the same as `shardline serve telemetry`."""

import sys

from services.common.service_main import run_service
from services.telemetry import server

sys.exit(run_service("telemetry", server, sys.argv[1:], prog="python -m services.telemetry"))
