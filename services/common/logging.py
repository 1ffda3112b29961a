"""One logging setup for every service and CLI command."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | None = None) -> None:
    """Configure the root logger once; level from the argument, SHARDLINE_LOG_LEVEL, or INFO."""
    level_name = (level or os.environ.get("SHARDLINE_LOG_LEVEL") or "INFO").upper()
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level_name, format=_FORMAT)
    else:
        root.setLevel(level_name)
