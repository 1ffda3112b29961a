"""Loopback ports for local processes: one any free port, a run of consecutive free ones, or a
replica group's rendezvous port."""

from __future__ import annotations

import random
import socket

# `--port-base B` takes B, B+1, ...: a run of ports chosen from below the kernel's ephemeral range
# (which starts at 32768 by default), so no outgoing connection or bind(0) takes one of them
# between the check here and the services binding them.
PORT_RUN_RANGE = (24_000, 32_000)


def free_port() -> int:
    """A loopback TCP port free now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_run(count: int, attempts: int = 200) -> int:
    """The first of ``count`` consecutive loopback ports that are all free now."""
    low, high = PORT_RUN_RANGE
    for _ in range(attempts):
        start = random.randrange(low, high - count)
        if all(bindable(start + i) for i in range(count)):
            return start
    raise OSError(f"no run of {count} free ports found in {low}..{high}")


def rendezvous_port() -> int:
    """A port for a replica group's rank 0 to listen on for its peers (MASTER_PORT): from below
    the ephemeral range, as for a run. A bind(0) port is the kernel's to hand out again as the
    source port of any outgoing connection before rank 0 binds it (EADDRINUSE, once in a full
    test run of many processes connecting)."""
    return free_port_run(1)
