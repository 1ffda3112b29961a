"""Loopback ports: a replica group's rendezvous port is one no outgoing connection can be given."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.common.ports import PORT_RUN_RANGE, rendezvous_port

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


def test_a_rendezvous_port_is_below_the_ephemeral_range_and_free():
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = rendezvous_port()
        assert PORT_RUN_RANGE[0] <= port < PORT_RUN_RANGE[1] < ephemeral_low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when handed out
