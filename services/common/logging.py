"""One logging setup for every service and CLI command."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_SAY_LOCK = threading.Lock()
STACKS_SIGNAL = signal.SIGUSR2  # a process that stops acting: every thread's stack to its log


def stacks_on_signal() -> None:
    """From now on ``STACKS_SIGNAL`` writes every thread's stack to the process's stderr (its log) and
    the process goes on, so a process that hangs can be asked where."""
    faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)


def configure_logging(level: str | None = None) -> None:
    """Configure the root logger once; level from the argument, SHARDLINE_LOG_LEVEL, or INFO."""
    level_name = (level or os.environ.get("SHARDLINE_LOG_LEVEL") or "INFO").upper()
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level_name, format=_FORMAT)
    else:
        root.setLevel(level_name)


def say_line(line: str) -> None:
    """One whole line on stdout, flushed. Fleet controllers report from their own threads while
    the main thread reports too, and ``print`` writes the text and its newline in two writes, so
    two reports could otherwise share a line (and a reader parsing the output miss both)."""
    with _SAY_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
