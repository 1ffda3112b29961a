"""`python -m services.telemetry`: the same as `shardline serve telemetry`."""

import sys

from services.cli.serve import run_service

sys.exit(run_service("telemetry", sys.argv[1:], prog="python -m services.telemetry"))
