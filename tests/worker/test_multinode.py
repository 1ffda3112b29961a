"""A replica group on two "hosts": two torchrun launches (one per node, static rendezvous on
loopback), each started by `shardline serve worker --nnodes 2 --node-rank R` from a pre-sharded
checkpoint in object storage (a real S3-API server), each node staging into a cache of its own;
real gRPC to the driver on node 0. The placement rule and the refusals are checked without
launching."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.common.health import make_health_store
from services.common.healthcheck import check, wait_serving
from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.registry import ShardRegistry, registry_group_id
from services.modeling.parallel.placement import PlacementError, check_launch, placement
from tests.stack import free_port
from tests.worker.oracle import reference_greedy

REPO = Path(__file__).resolve().parents[2]


def test_nodes_take_ranks_in_order_and_stages_map_to_nodes() -> None:
    nodes = placement(8, 2, 8)
    assert [n.ranks for n in nodes] == [tuple(range(8)), tuple(range(8, 16))]
    assert [n.stages for n in nodes] == [(0,), (1,)]
    assert check_launch(2, 2, nnodes=2, node_rank=1, local_world_size=2, world_size=4).ranks == (2, 3)


@pytest.mark.parametrize("launch,needle", [
    (dict(nnodes=2, node_rank=0, local_world_size=2, world_size=6), "needs a world of 4 ranks"),
    (dict(nnodes=3, node_rank=0, local_world_size=1, world_size=4), "is not the world of 4"),
    (dict(nnodes=4, node_rank=5, local_world_size=1, world_size=4), "node rank 5 outside 0..3"),
])
def test_a_launch_that_contradicts_the_plan_is_refused_naming_it(launch, needle) -> None:
    with pytest.raises(PlacementError, match=needle) as info:
        check_launch(2, 2, **launch)
    assert "the plan TP=2 x PP=2" in str(info.value)


def test_a_tp_group_split_across_nodes_needs_the_flag() -> None:
    with pytest.raises(PlacementError, match="splits a TP group across nodes"):
        check_launch(2, 1, nnodes=2, node_rank=0, local_world_size=1, world_size=2)
    assert check_launch(2, 1, nnodes=2, node_rank=0, local_world_size=1, world_size=2,
                        allow_cross_node_tp=True).ranks == (0,)


def test_the_plan_prints_rank_to_node_placement() -> None:
    out = subprocess.run([sys.executable, "-m", "services.cli", "plan", "--model", "llama3-70b", "--topology",
                          "a100-80g-8x", "--nodes", "2", "--tp", "8", "--pp", "2"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert "Placement: 2 node(s) of 8 GPUs" in out
    assert "node 1: ranks 8 (pp1-tp0)" in out


def test_the_worker_refuses_a_contradicting_launch_before_loading(tiny_model_dir) -> None:
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "worker", "--model", str(tiny_model_dir),
                           "--tp", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "refused" in done.stdout and "splits a TP group across nodes" in done.stdout


def _node(checkpoint: str, rank: int, rdzv: str, port: int, log: Path, cache: Path, *flags: str) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "worker", "--checkpoint", checkpoint, "--pp", "2",
             "--port", str(port), "--collective-timeout", "2", "--nnodes", "2", "--node-rank", str(rank),
             "--rdzv-endpoint", rdzv, *flags],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "SHARDLINE_HOST": "127.0.0.1", "SHARDLINE_SHARD_CACHE": str(cache)})


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts each rank in a session of its own, so killing
    the launcher's process group would leave the ranks running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_node(proc: subprocess.Popen) -> None:
    for pid in _tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _status(address: str) -> str:
    try:
        return check(address, timeout_s=1.0)
    except grpc.RpcError:  # the driver has exited
        return "GONE"


def test_a_pipeline_across_two_nodes_serves_and_fails_when_node_1_dies(tiny_model_dir, tmp_path, s3_bucket,
                                                                      postgres_url, redis_url) -> None:
    checkpoint = f"s3://{s3_bucket}/tiny-pp2"
    subprocess.run([sys.executable, "-m", "services.cli", "shard", "--model", str(tiny_model_dir), "--tp", "1", "--pp",
                    "2", "--dtype", "float32", "--out", checkpoint], cwd=REPO, check=True, capture_output=True)
    rdzv, port = f"127.0.0.1:{free_port()}", free_port()
    name = f"rg-twonode-{os.getpid()}-{port}"
    flags = ("--registry-url", postgres_url, "--redis-url", redis_url, "--replica-group-id", name)
    caches = [tmp_path / f"cache{r}" for r in (0, 1)]
    nodes = [_node(f"{checkpoint}/manifest.json", r, rdzv, port, tmp_path / f"node{r}.log", caches[r], *flags)
             for r in (0, 1)]
    try:
        address = f"127.0.0.1:{port}"
        problem = wait_serving(nodes[0], address, timeout_s=120)
        logs = lambda: "\n".join(p.read_text() for p in sorted(tmp_path.glob("node*.log")))  # noqa: E731
        assert problem is None, f"driver {problem}:\n{logs()}"
        channel = grpc.insecure_channel(address)
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        prompt = [5, 80, 200, 31, 7, 99]
        events = list(stub.Generate(worker_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParameters(temperature=0, max_tokens=16, ignore_eos=True))))
        ids = [e.token.token_id for e in events if e.WhichOneof("event") == "token"]
        assert ids == reference_greedy(tiny_model_dir, prompt, 16), logs()
        # each node staged only its own rank's shard into its cache
        staged = [sorted(p.name for p in cache.rglob("*.safetensors")) for cache in caches]
        assert staged == [["model-tp00-pp00.safetensors"], ["model-tp00-pp01.safetensors"]], staged
        stats = stub.Stats(worker_pb2.StatsRequest())
        assert (stats.layout.tp_degree, stats.layout.pp_degree) == (1, 2)
        health = make_health_store(redis_url)
        deadline = time.monotonic() + 5  # each node beats for its own rank
        while set(health.group_health(name)) != {"pp0_tp0", "pp1_tp0"} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.group_health(name) == {"pp0_tp0": "healthy", "pp1_tp0": "healthy"}
        # the driver registered each stage's shard with the node its rank runs on
        registry = ShardRegistry(postgres_url)
        group = registry_group_id(name)
        host = socket.gethostname()
        assert {s.gpu_id: s.node_id for s in registry.shards_of(group)} == {
            f"{name}:pp0-tp0": f"{host}-node0", f"{name}:pp1-tp0": f"{host}-node1"}

        _kill_node(nodes[1])  # every process of node 1: its torchrun and its rank
        t0 = time.monotonic()
        while _status(address) == "SERVING" and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert _status(address) != "SERVING", logs()
        # the idle heartbeat's collective notices within its timeout (2 s) plus the idle period
        assert time.monotonic() - t0 < 2 + 1 + 3, logs()
        deadline = time.monotonic() + 10
        while registry.get_group(group).status != "dead" and time.monotonic() < deadline:
            time.sleep(0.1)
        record = registry.get_group(group)
        assert record.status == "dead", logs()
        # node 1's rank stopped renewing its health entry: the reason names that node
        assert record.status_reason.startswith(f"node {host}-node1 stopped reporting;"), record.status_reason
        channel.close()
    finally:
        for proc in nodes:
            _kill_node(proc)
            proc.wait(timeout=10)
