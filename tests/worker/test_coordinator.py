"""Every collective goes through the coordinator; a dead or hung rank fails fast and loudly."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.modeling.parallel.plan import ParallelPlan
from services.worker.launch import ReplicaGroupFailed, run_replica_group
from services.worker.runtime import RankRuntime, RankSpec
from services.worker.scoring import prefill_logprobs
from tests.worker.test_parallel_parity import make_tiny, random_ids

pytestmark = pytest.mark.waits  # on collective timeouts (tests/lanes.py)


def _counting_rank(rank: int, world_size: int, spec: RankSpec, ids: list[int], out_dir: str) -> None:
    rt = RankRuntime.start(spec, rank)
    prefill_logprobs(rt, ids if rank == 0 else None)
    counts = collections.Counter(event.op_type for event in rt.events.snapshot())
    timed_out = sum(event.timed_out for event in rt.events.snapshot())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"counts": counts, "timed_out": timed_out,
                                                             "load_delta": rt.load_peak_rss_delta_bytes,
                                                             "loaded": rt.loaded_bytes}))


def expected_events(plan: ParallelPlan, rank: int) -> dict[str, int]:
    """What a TP×PP prefill must issue on ``rank``, derived from the layout."""
    stage, tp_rank = plan.coords(rank)
    layers = len(plan.stage_layers(stage))
    counts: collections.Counter[str] = collections.Counter()
    counts["barrier"] += 1  # after loading
    counts["broadcast"] += 2  # the driver's token ids: size, then payload
    if plan.tp_degree > 1:
        # o_proj and down_proj of every layer: the fixed k-chunks' products gathered in the
        # layout-invariant numerics (the default), summed by the backend's all-reduce per-layout
        counts["all_gather" if plan.invariant_chunks else "all_reduce"] += 2 * layers
        if stage == 0:
            counts["all_reduce"] += 1  # vocab-parallel embedding
        if stage == plan.pp_degree - 1:
            counts["all_gather"] += 1  # logits
    if stage < plan.pp_degree - 1:
        counts["send"] += 1  # hidden states to the next stage
    if stage > 0:
        counts["recv"] += 1
    last_leader = plan.rank_of(plan.pp_degree - 1, 0)
    if last_leader != 0 and rank == last_leader:
        counts["send"] += 1  # the result, to the driver (one op: size + payload)
    if last_leader != 0 and rank == 0:
        counts["recv"] += 2  # size, then payload
    return dict(counts)


def test_every_collective_of_a_tp2_pp2_prefill_is_recorded(tiny_model_dir, tmp_path):
    spec = RankSpec(str(tiny_model_dir), tp_degree=2, pp_degree=2)
    run_replica_group(4, _counting_rank, spec, random_ids(70, 512), str(tmp_path))
    plan = spec.plan
    for rank in range(4):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["counts"] == expected_events(plan, rank), rank
        assert got["timed_out"] == 0


def test_tp1_pp1_makes_no_collective_calls(tiny_model_dir, tmp_path):
    spec = RankSpec(str(tiny_model_dir))
    run_replica_group(1, _counting_rank, spec, random_ids(20, 512), str(tmp_path))
    assert json.loads((tmp_path / "rank0.json").read_text())["counts"] == {}


def _score_with_fault(model_dir: str, fault: str, timeout_s: float = 2.0) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, SHARDLINE_FAULTS=fault)
    ids = ",".join(map(str, random_ids(64, 512)))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "score", "--model", model_dir, "--tp", "2",
                           "--pp", "2", "--ids", ids, "--json", "--collective-timeout", str(timeout_s),
                           "--replica-group-id", "rg-test"],
                          env=env, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - t0


def _waits(stderr: str) -> list[float]:
    return [float(x) for x in re.findall(r"after waiting ([0-9.]+) s", stderr)]


# A rank gives up at its timeout, but one starved of CPU (the other pytest-xdist worker's ranks
# on the same cores) notices seconds late: measured up to 1.7 s past it at load 14. A hang would
# be the 120 s of _score_with_fault.
SCHEDULING_SLACK_S = 3.0


def test_sigkilled_rank_fails_the_group_fast(tiny_model_dir):
    # its third row-parallel gather
    proc, _ = _score_with_fault(str(tiny_model_dir), "rank=1,op=all_gather,after=2,action=kill")
    assert proc.returncode == 1, proc.stderr
    assert "rank 1: process died from signal SIGKILL" in proc.stderr
    assert "ShardGroupUnhealthy: replica group rg-test is unhealthy: all_gather on rg-test:pp0-tp0" in proc.stderr
    waits = _waits(proc.stderr)
    assert waits and max(waits) <= 2.0 + SCHEDULING_SLACK_S, proc.stderr


@pytest.mark.slow
def test_stopped_rank_times_out_instead_of_hanging(tiny_model_dir):
    proc, elapsed = _score_with_fault(str(tiny_model_dir), "rank=3,op=recv,action=stop", timeout_s=1.5)
    assert proc.returncode == 1, proc.stderr
    assert "replica group rg-test is unhealthy" in proc.stderr
    assert "timed out after 1.5 s" in proc.stderr
    waits = _waits(proc.stderr)
    # collectives give up after one timeout; stage-boundary send/recv after their one retry
    assert waits and all(w <= 2 * 1.5 + SCHEDULING_SLACK_S for w in waits), proc.stderr
    assert elapsed < 60


def _link_rank(rank: int, world_size: int, faults: str, out_dir: str, timeout_s: float) -> None:
    """Stage 0 (rank 0) sends four tensors to stage 1 (rank 1) through the coordinator, then both
    meet at a barrier; ``faults`` delay or stall rank 1's receives."""
    import torch
    import torch.distributed as dist

    from services.common.collective_events import RingBufferSink
    from services.modeling.parallel.coordinator import Coordinator, ShardGroupUnhealthy
    from services.modeling.parallel.faults import FaultInjector
    from services.modeling.parallel.groups import ParallelGroups

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    pp_group = dist.new_group([0, 1], backend="gloo")
    control = dist.new_group([0, 1], backend="gloo")
    groups = ParallelGroups(1, 2, rank, "gloo", None, pp_group, control)
    sink = RingBufferSink()
    coordinator = Coordinator(groups, replica_group_id="rg-link", timeout_s=timeout_s, sink=sink,
                              faults=FaultInjector(rank, faults))
    got, error = [], None
    try:
        for step in range(4):
            if rank == 0:
                coordinator.send(torch.full((8,), float(step)), dst_stage=1)
            else:
                got.append(coordinator.recv((8,), torch.float32, src_stage=0).tolist())
        coordinator.barrier()
    except ShardGroupUnhealthy as exc:
        error = str(exc)
        raise
    finally:
        events = [[e.op_type, round(e.duration_ms), e.timed_out, e.peer_lost] for e in sink.snapshot()]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"events": events, "got": got, "error": error}))


def _link_events(out_dir: Path, rank: int) -> dict:
    return json.loads((out_dir / f"rank{rank}.json").read_text())


def test_a_late_stage_boundary_recv_is_retried_once_and_the_group_goes_on(tmp_path):
    # rank 1 posts its second receive 1.5 s late: rank 0's send waits past its 1 s timeout, the
    # coordinator waits once more, the send completes within the retry and the group carries on
    run_replica_group(2, _link_rank, "rank=1,op=recv,after=1,times=1,action=sleep:1.5", str(tmp_path), 1.0)
    sender, receiver = _link_events(tmp_path, 0), _link_events(tmp_path, 1)
    assert sender["error"] is None and receiver["error"] is None
    assert receiver["got"] == [[float(step)] * 8 for step in range(4)]
    sends = [e for e in sender["events"] if e[0] == "send"]
    # the second send is two events: its first wait timed out, its retry completed
    assert [e[2] for e in sends] == [False, True, False, False, False]
    assert sends[1][1] == 1000  # the first wait: exactly the timeout
    assert 200 <= sends[2][1] <= 1000  # the retry: the rest of rank 1's 1.5 s delay
    assert [e[0] for e in sender["events"]].count("barrier") == 1  # the group still works
    assert not any(e[2] for e in receiver["events"])  # the late rank itself never waited long


def test_a_stage_boundary_send_that_times_out_again_after_its_retry_fails_the_group(tmp_path):
    # rank 1 stops for good at its second receive: rank 0's send times out, is retried, times out again
    t0 = time.monotonic()
    with pytest.raises(ReplicaGroupFailed) as failed:
        run_replica_group(2, _link_rank, "rank=1,op=recv,after=1,action=stop", str(tmp_path), 1.0,
                          failure_grace_s=1.0)
    assert time.monotonic() - t0 < 30
    sender = _link_events(tmp_path, 0)
    assert "replica group rg-link is unhealthy: send on rg-link:pp0-tp0 timed out after 1 s, and again " \
           "after its retry" in sender["error"]
    assert 2.0 <= _waits(sender["error"])[0] <= 3.0
    assert [e[0] for e in sender["events"]] == ["send", "send", "send"]
    assert [e[2] for e in sender["events"]] == [False, True, True]  # the wait, the retry
    assert not any(e[3] for e in sender["events"])  # timed out: its peer was not lost
    # the retry waits the same 1 s again, not a longer timeout: its measured duration is at least
    # ~1 s and below 2 s. Not 1 s +/- 0.1: a fresh-clone suite run on the 2-core Xeon measured 1475 ms
    # while the other xdist worker loaded its cores (the timeout fires on time; noticing it waits for a core)
    durations = [e[1] for e in sender["events"]][1:]
    assert durations[0] == 1000 and 900 <= durations[1] < 2000, durations
    assert "rank 0: ShardGroupUnhealthy" in str(failed.value)


def test_a_killed_peer_fails_the_op_at_once_as_peer_lost(tmp_path):
    # rank 1 dies at its second receive: its connections close, and rank 0's next op fails on the
    # transport well before its 5 s timeout, recorded as ``peer_lost`` (telemetry then fails the
    # group at once instead of reading a link flap)
    with pytest.raises(ReplicaGroupFailed):
        run_replica_group(2, _link_rank, "rank=1,op=recv,after=1,action=kill", str(tmp_path), 5.0,
                          failure_grace_s=1.0)
    sender = _link_events(tmp_path, 0)
    last = sender["events"][-1]
    assert last[2] and last[3] and last[1] < 5000, sender["events"]
    assert not any(e[3] for e in sender["events"][:-1])
    assert "failed (" in sender["error"], sender["error"]


def test_replica_group_failed_lists_every_rank():
    err = ReplicaGroupFailed({1: "process died from signal SIGKILL", 0: "ShardGroupUnhealthy: x"})
    assert str(err).splitlines() == ["replica group failed:", "  rank 0: ShardGroupUnhealthy: x",
                                     "  rank 1: process died from signal SIGKILL"]


@pytest.mark.slow
def test_loading_peak_memory_is_about_the_shard(tmp_path_factory, tmp_path):
    """Each TP2/PP2 rank reads only its slices: its peak RSS growth is ~1/4 of the model, not all of it."""
    model_dir = make_tiny(tmp_path_factory.mktemp("mid"), "--layers", "8", "--hidden", "768", "--heads", "12",
                          "--kv-heads", "4", "--intermediate", "3072", "--vocab", "32000")
    model_bytes = (Path(model_dir) / "model.safetensors").stat().st_size
    spec = RankSpec(model_dir, tp_degree=2, pp_degree=2)
    run_replica_group(4, _counting_rank, spec, random_ids(8, 32000), str(tmp_path))
    for rank in range(4):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"rank {rank}: shard {got['loaded'] / 2**20:.0f} MiB, load peak RSS growth "
              f"{got['load_delta'] / 2**20:.0f} MiB, model {model_bytes / 2**20:.0f} MiB")
        assert got["loaded"] < 0.3 * model_bytes
        # RSS counts the rank's own parameters (1x the shard) and the checkpoint's mmapped pages it
        # touches: a column-parallel slice's own rows, but a row-parallel slice (o_proj, down_proj:
        # a third of these layers' bytes) strides through its whole tensor, twice its share. That
        # is ~2.35x the shard, plus one slice in flight and the allocator's slack (measured 2.4x to
        # 2.55x alone, up to 2.85x in a full parallel run): never the model (4x the shard)
        assert got["load_delta"] < 3.0 * got["loaded"] and got["load_delta"] < 0.8 * model_bytes
        assert got["load_delta"] < 0.75 * model_bytes
