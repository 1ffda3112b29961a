"""`shardline up` end to end: the router's /metrics counts exactly the collectives the requests
needed, and the router and the worker serve vLLM's metrics (names, types, labels) with the
requests' own figures.

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
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import grpc
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import child_environ
from services.common.proto import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
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


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("up-metrics")
    ports = {"router": free_port(), "http": free_port(), "base": free_port(), "state": tmp_path / "state"}
    argv = [sys.executable, "-m", "services.cli", "up", "--model", "tiny", "--tp", str(TP), "--pp", str(PP),
            "--dtype", "float32", "--port", str(ports["router"]), "--http-port", str(ports["http"]),
            "--port-base", str(ports["base"]), "--kv-cache-gb", "0.01", "--log-dir", str(tmp_path / "logs")]
    env = child_environ(SHARDLINE_MODEL_CACHE=str(tmp_path / "models"), SHARDLINE_STATE_DIR=str(ports["state"]))
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
    # 13 steps: all_gather 13 x (4 ranks x 2 layers x 2 row-parallel chunk gathers + 2 logits) = 234,
    # all_reduce 13 x 2 embedding on stage 0 = 26, send 13 x 2 hidden + 12 results = 38, recv 13 x 2
    # hidden + 13 x 2 on the driver = 52
    assert expected == {"all_gather": 18 * steps, "all_reduce": 2 * steps, "send": 3 * steps - 1,
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


# vLLM 0.32's series (vllm/v1/metrics/loggers.py): name -> Prometheus type
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
}
WORKER_ONLY = {"vllm:iteration_tokens_total": "histogram"}


def vllm_families(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return {f.name: f for f in text_string_to_metric_families(response.read().decode())
                if f.name.startswith("vllm:")}


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    """The sum of ``sample``'s values whose labels include ``labels`` (0 if none)."""
    family = families.get(sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum"))
    return sum(s.value for s in family.samples if s.name == sample and labels.items() <= s.labels.items()) \
        if family is not None else 0.0


def live_stack(stack) -> tuple[openai.OpenAI, Any, int, dict[str, str]]:
    """The stack's openai client, its one group (as the router lists it), the worker's metrics
    port and the router's and the worker's /metrics URLs."""
    ports, _model_dir, _log = stack
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="none", max_retries=0)
    with grpc.insecure_channel(f"127.0.0.1:{ports['router']}") as channel:
        (info,) = router_pb2_grpc.RouterServiceStub(channel).ListReplicaGroups(
            router_pb2.ListReplicaGroupsRequest(), timeout=5).groups
    with grpc.insecure_channel(info.address) as channel:
        stats = worker_pb2_grpc.WorkerServiceStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
    urls = {"router": f"http://127.0.0.1:{ports['http']}/metrics",
            "worker": f"http://{info.address.rsplit(':', 1)[0]}:{stats.metrics_port}/metrics"}
    return client, info, stats.metrics_port, urls


@pytest.mark.slow
def test_the_router_and_the_worker_serve_vllms_metrics_with_the_requests_figures(stack):
    client, info, metrics_port, urls = live_stack(stack)
    assert metrics_port > 0  # a worker serves /metrics by default
    router_url, worker_url = urls["router"], urls["worker"]
    before = {"router": vllm_families(router_url), "worker": vllm_families(worker_url)}

    def counted(where: str, families: dict[str, Any], sample: str, **labels: str) -> float:
        """What the requests of this test added to ``sample``."""
        return value(families, sample, **labels) - value(before[where], sample, **labels)

    prompt_tokens = generated = 0
    for prompt, max_tokens in REQUESTS:
        done = complete(client, prompt, max_tokens)
        prompt_tokens, generated = prompt_tokens + len(prompt), generated + max_tokens
    stream = client.completions.create(model="tiny-llama", prompt=[3, 4, 5], max_tokens=5, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert [c.choices[0].finish_reason for c in stream][-1] == "length"
    prompt_tokens, generated, sent = prompt_tokens + 3, generated + 5, len(REQUESTS) + 1

    for where, url, labels in (("router", router_url, ("model_name", "engine", "replica_group")),
                               ("worker", worker_url, ("model_name", "engine"))):
        families = wait_until(lambda url=url, where=where: (f := vllm_families(url)) and counted(
            where, f, "vllm:e2e_request_latency_seconds_count") >= sent and f, 10)
        expected = {**VLLM_FAMILIES, **(WORKER_ONLY if where == "worker" else {})}
        assert {name: families[name].type for name in expected if name in families} == expected, where
        for name in expected:
            for sample in families[name].samples:
                assert set(labels) <= set(sample.labels), (where, sample)
                assert sample.labels["model_name"] == "tiny-llama" and sample.labels["engine"] == "0"
        mine = {"replica_group": done.replica_group_id} if where == "router" else {}
        assert counted(where, families, "vllm:request_success_total", finished_reason="length", **mine) == sent
        assert counted(where, families, "vllm:prompt_tokens_total", **mine) == prompt_tokens, where
        assert counted(where, families, "vllm:generation_tokens_total", **mine) == generated, where
        for histogram in ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                          "vllm:request_generation_tokens", "vllm:request_prompt_tokens"):
            assert counted(where, families, f"{histogram}_count", **mine) == sent, (where, histogram)
        assert counted(where, families, "vllm:request_generation_tokens_sum", **mine) == generated
        # one interval between each two tokens of a request
        assert counted(where, families, "vllm:inter_token_latency_seconds_count", **mine) == generated - sent
        assert 0 < counted(where, families, "vllm:e2e_request_latency_seconds_sum", **mine) < 60
        assert 0.0 <= value(families, "vllm:kv_cache_usage_perc", **mine) <= 1.0
    # the router's gauge of the group is the worker's own figure (both idle now)
    with grpc.insecure_channel(info.address) as channel:
        stats = worker_pb2_grpc.WorkerServiceStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
    worker_usage = stats.kv_bytes_used / stats.kv_bytes_capacity
    assert value(vllm_families(worker_url), "vllm:kv_cache_usage_perc") == pytest.approx(worker_usage)
    assert value(vllm_families(worker_url), "vllm:num_requests_running") == 0

    def router_sees_idle_group() -> bool:  # as of the group's next Stats
        families = vllm_families(router_url)
        return (value(families, "vllm:num_requests_running", replica_group=info.replica_group_id) == 0 and
                value(families, "vllm:kv_cache_usage_perc", replica_group=info.replica_group_id)
                == pytest.approx(worker_usage))

    assert wait_until(router_sees_idle_group, 5)

@pytest.mark.slow
def test_a_stop_string_counts_as_stop_on_the_router_that_matched_it_and_on_the_worker(stack):
    """The router matches stop strings (the worker gets none) and tells the worker, which counts
    the request as finished by a stop string, not as an abort."""
    client, _info, _port, urls = live_stack(stack)
    before = {where: value(vllm_families(url), "vllm:request_success_total", finished_reason="stop")
              for where, url in urls.items()}
    text = complete(client, [5, 6, 7, 8, 9], 24).choices[0].text
    stop = next(c for c in text if c.isalnum())  # a character the greedy text reaches
    done = client.completions.create(model="tiny-llama", prompt=[5, 6, 7, 8, 9], max_tokens=24, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True}, timeout=60)
    assert done.choices[0].finish_reason == "stop" and stop not in done.choices[0].text
    assert text.startswith(done.choices[0].text) and done.choices[0].stop_reason == stop  # vLLM's field
    streamed = list(client.completions.create(model="tiny-llama", prompt=[5, 6, 7, 8, 9], max_tokens=24,
                                              temperature=0, stop=[stop], stream=True,
                                              extra_body={"ignore_eos": True}, timeout=60))
    assert (streamed[-1].choices[0].finish_reason, streamed[-1].choices[0].stop_reason) == ("stop", stop)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    for where, url in urls.items():
        assert wait_until(lambda url=url, where=where: value(vllm_families(url), "vllm:request_success_total",
                                                             finished_reason="stop") == before[where] + 2, 10), where
    assert value(vllm_families(urls["worker"]), "vllm:num_requests_running") == 0


OBSERVABILITY = REPO / "deploy" / "observability"


def metric_names(promql: str) -> set[str]:
    """The metric families a PromQL expression reads (suffixes of histograms and counters off)."""
    names = set(re.findall(r"\b(vllm:[a-z0-9_]+|shardline_[a-z0-9_]+)", promql))
    return {re.sub(r"_(bucket|count|sum|total)$", "", name) for name in names}


@pytest.mark.slow
def test_every_metric_of_the_dashboard_and_the_alert_rules_is_in_a_live_scrape(stack):
    ports, _model_dir, _log = stack
    committed = json.loads((OBSERVABILITY / "shardline-dashboard.json").read_text())
    built = subprocess.run([sys.executable, str(OBSERVABILITY / "dashboard.py")], capture_output=True, text=True,
                           check=True, timeout=60).stdout
    assert committed == json.loads(built), "shardline-dashboard.json is stale: run deploy/observability/dashboard.py"
    panels = [p for p in committed["panels"] if p["type"] != "row"]
    assert {p["title"] for p in committed["panels"] if p["type"] == "row"} == {"Fleet", "Latency", "Collectives",
                                                                               "Quality"}
    rules = yaml.safe_load((OBSERVABILITY / "shardline-alerts.yaml").read_text())
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert all({"alert", "expr", "labels", "annotations"} <= set(rule) for rule in alerts)
    assert {"ShardlineGroupUnhealthy", "ShardlineTpotOverSlo", "ShardlineKvPressureWithoutScaleOut",
            "ShardlineRolloutFailed", "ShardlineCollectiveAlerts"} <= {rule["alert"] for rule in alerts}
    promtool = shutil.which("promtool")  # `make test` installs it (Debian's prometheus package)
    if promtool is not None:
        checked = subprocess.run([promtool, "check", "rules", str(OBSERVABILITY / "shardline-alerts.yaml")],
                                 capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0 and f"SUCCESS: {len(alerts)} rules found" in checked.stdout, checked

    # one scrape target: the router's /metrics (its own, telemetry's and the fleet controller's)
    def scraped() -> set[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/metrics", timeout=5) as response:
            return {f.name for f in text_string_to_metric_families(response.read().decode())}

    wanted = {name for p in panels for t in p["targets"] for name in metric_names(t["expr"])}
    wanted |= {name for rule in alerts for name in metric_names(rule["expr"])}
    assert len(wanted) > 20
    names = wait_until(lambda: (names := scraped()) >= wanted and names, 10) or scraped()
    assert wanted <= names, f"not in the scrape: {sorted(wanted - names)}"


@pytest.mark.slow
def test_top_once_prints_every_group_with_its_figures(stack):
    ports, _model_dir, _log = stack
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="none", max_retries=0)
    done = complete(client, [5, 6, 7], 8)  # latencies to show, whatever ran before
    env = child_environ(SHARDLINE_STATE_DIR=str(ports["state"]))  # the stack's embedded registry
    top = subprocess.run([sys.executable, "-m", "services.cli", "top", "--once", "--router",
                          f"127.0.0.1:{ports['router']}", "--metrics-url", f"http://127.0.0.1:{ports['http']}/metrics"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    print(top.stdout)
    lines = top.stdout.splitlines()
    assert "latencies since the router started" in lines[0]
    assert any(line.startswith("fleet tiny-llama: revision 1") for line in lines), top.stdout
    (row,) = [line for line in lines if line.startswith(done.replica_group_id)]
    group, plan, status, kv, running, waiting, ttft, tpot, rate = _cells(row)
    assert (group, plan, status) == (done.replica_group_id, "TP2 x PP2 float32", "healthy")
    assert 0.0 <= float(kv) <= 100.0 and (running, waiting) == ("0", "0")
    for cell in (ttft, tpot):  # p50/p99 in ms, measured
        p50, p99 = (float(v) for v in cell.split("/"))
        assert 0 <= p50 <= p99
    assert rate == "0.0"  # nothing ran in the second between its two scrapes


def _cells(row: str) -> list[str]:
    """A ``top`` row's cells: the group, the plan (``TP2 x PP2 float32``), then one word each."""
    words = row.split()
    return [words[0], " ".join(words[1:5]), *words[5:]]
