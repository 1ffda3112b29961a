"""`shardline up` end to end: the router's /metrics counts exactly the collectives the requests needed.

One replica group of the tiny model at TP2 x PP2 (float32) behind the real router, telemetry,
loader and planner processes. The test sends greedy requests one at a time through the router's
OpenAI-compatible HTTP API, then scrapes the router's ``/metrics`` (which re-exports telemetry's
collective histograms) and compares each op's ``shardline_collective_duration_seconds_count``
with what it computes from the layout and the engine steps the requests took.

Steps. Requests go one at a time, each prompt below the step token budget (one chunk) and with
``ignore_eos``, so a request of ``max_tokens`` is exactly one prefill step that samples the first
token, then ``max_tokens - 1`` decode steps; a single sequence is never in two micro-batches, so
PP overlap cannot merge steps either.

Per step, on each rank (``expected_step_events``, the layout rules tests/worker derives a TP2/PP2
prefill from): two all-reduces per layer of the rank's stage (o_proj, down_proj), one more on
stage 0 (the vocab-parallel embedding), one all-gather per TP rank of the last stage (the
logits), one send of the hidden states from each stage-0 rank and the matching recv on stage 1,
and the step's samples from the last stage's TP rank 0 to the driver (one send op there, two
recv ops on the driver: size, then payload). Plus two barriers per rank: weights loaded, KV
cache allocated.

Two things are timing-dependent and handled as such: the sampling rank's result send is
*deferred* (gloo would deadlock the pipeline if it waited at once; it is waited for, and
recorded, at its next send or at stop), so while the stack is up the last step's result send is
not recorded yet: ``steps - 1`` of them. Broadcasts include the driver's idle heartbeats (2 ops
every 0.5 s while idle), so they get a lower bound only.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from services.common.config import child_environ
from services.modeling.parallel.plan import ParallelPlan
from services.worker.runtime import RankSpec
from tests.router.processes import REPO
from tests.stack import free_port
from tests.telemetry.procs import scrape, wait_until
from tests.telemetry.test_serving_telemetry import expected_step_events

TP, PP = 2, 2
# (prompt token ids, max_tokens): prompts far below the step token budget (one prefill chunk)
REQUESTS = [([5, 6, 7, 8, 9], 4), (list(range(20, 57)), 3), ([11], 6)]
EXACT_OPS = ("all_reduce", "all_gather", "send", "recv", "barrier")


def expected_totals(plan: ParallelPlan, steps: int) -> dict[str, int]:
    """Each op's count summed over the group's ranks, as the stack shows it while still up."""
    totals: collections.Counter[str] = collections.Counter()
    for rank in range(plan.world_size):
        totals["barrier"] += 2  # after loading the weights, after allocating the KV cache
        for op, n in expected_step_events(plan, rank).items():
            totals[op] += n * steps
    if plan.rank_of(plan.pp_degree - 1, 0) != 0:
        totals["send"] -= 1  # the last step's deferred result send is recorded at the next send or at stop
    return dict(totals)


def router_counts(http_port: int, group_prefix: str) -> dict[str, int]:
    """``shardline_collective_duration_seconds_count`` per op_type, summed over the group's series."""
    samples = scrape(f"http://127.0.0.1:{http_port}/metrics").get("shardline_collective_duration_seconds_count", [])
    counts: collections.Counter[str] = collections.Counter()
    for labels, value in samples:
        if labels["replica_group_id"].startswith(group_prefix):
            counts[labels["op_type"]] += int(value)
    return dict(counts)


@pytest.fixture
def stack(tmp_path):
    ports = {"router": free_port(), "http": free_port(), "base": free_port()}
    argv = [sys.executable, "-m", "services.cli", "up", "--model", "tiny", "--tp", str(TP), "--pp", str(PP),
            "--dtype", "float32", "--port", str(ports["router"]), "--http-port", str(ports["http"]),
            "--port-base", str(ports["base"]), "--kv-cache-gb", "0.01", "--log-dir", str(tmp_path / "logs")]
    env = child_environ(SHARDLINE_MODEL_CACHE=str(tmp_path / "models"), SHARDLINE_STATE_DIR=str(tmp_path / "state"))
    log = tmp_path / "up.out"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C stops the stack." not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield ports, tmp_path / "models" / "tiny-llama", log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete(client: openai.OpenAI, prompt: list[int], max_tokens: int):
    return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, timeout=60)


@pytest.mark.slow
def test_router_metrics_count_the_collectives_the_requests_needed(stack):
    ports, model_dir, log = stack
    plan = RankSpec(str(model_dir), tp_degree=TP, pp_degree=PP, dtype="float32").plan
    assert [len(plan.stage_layers(s)) for s in range(PP)] == [2, 2]  # the tiny model's 4 layers, split
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="none", max_retries=0)
    groups = set()
    for prompt, max_tokens in REQUESTS:  # one at a time: each step carries exactly one request
        done = complete(client, prompt, max_tokens)
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), max_tokens), done
        assert done.choices[0].finish_reason == "length"
        groups.add(done.replica_group_id)
    (group,) = groups
    assert group.startswith("tiny-llama-")  # the one group of the fleet `up` applied
    steps = sum(max_tokens for _, max_tokens in REQUESTS)  # a prefill step, then one per further token
    totals = expected_totals(plan, steps)
    expected = {op: totals.get(op, 0) for op in EXACT_OPS}
    # 13 steps: all_reduce 13 x (4 ranks x 2 layers x 2 + 2 embedding on stage 0) = 234, all_gather
    # 13 x 2 = 26, send 13 x 2 hidden + 12 results = 38, recv 13 x 2 hidden + 13 x 2 on the driver = 52
    assert expected == {"all_reduce": 18 * steps, "all_gather": 2 * steps, "send": 3 * steps - 1,
                        "recv": 4 * steps, "barrier": 8}

    def exact() -> dict[str, int]:
        counts = router_counts(ports["http"], group)
        return {op: counts.get(op, 0) for op in EXACT_OPS}

    # the ranks' shippers send batches in the background: wait for the counts to arrive ...
    wait_until(lambda: exact() == expected, 20, interval_s=0.3)
    assert exact() == expected
    time.sleep(1.0)  # ... and stay put (no event counted twice or arriving late)
    counts = router_counts(ports["http"], group)
    assert {op: counts.get(op, 0) for op in EXACT_OPS} == expected
    # every step's plan is a 2-op broadcast on each of the 4 ranks, plus idle heartbeats
    assert counts["broadcast"] >= totals["broadcast"] == 2 * plan.world_size * steps
