"""Outside torchrun a worker serves only as its group's driver: started as a follower rank of a group
whose driver is elsewhere, without torchrun's launch, it refuses before loading anything and says how
a multi-node group is started (test_multinode.py runs one)."""

from __future__ import annotations

import pytest

from services.cli.serve import service_parser
from services.worker import server


def test_a_worker_with_a_nonzero_rank_refuses_to_serve(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "g-0.g.serving")
    args = service_parser("worker", prog="shardline serve worker").parse_args(
        ["--model", "/nonexistent", "--tp", "2", "--pp", "2"])
    assert server.serve(args) == 2
    out = capsys.readouterr().out
    assert "RANK=3 of WORLD_SIZE=4 (MASTER_ADDR=g-0.g.serving)" in out
    assert "outside torchrun" in out and "--nnodes N --node-rank R --rdzv-endpoint HOST:PORT" in out
