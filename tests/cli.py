"""`shardline ARGV` run in the test's own process."""

from __future__ import annotations

import contextlib
import io
import subprocess

from services.cli import main as cli_main


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """``shardline ARGV`` in this process: its exit code, stdout and stderr, as
    ``subprocess.run(..., capture_output=True, text=True)`` gives them. For tests of a command,
    not of the process boundary: a fresh interpreter importing torch and the CLI costs ~2.5 s a
    call, and the ranks of a TP/PP plan are still processes of their own."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli_main(list(argv))
    return subprocess.CompletedProcess(["shardline", *argv], code, stdout.getvalue(), stderr.getvalue())
