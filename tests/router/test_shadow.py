"""Shadow traffic: the rolling window's figures against the golden-set comparison's, the mirror's
queue, candidates and alerts on the domain module; end to end, `shardline up --replicas 2` with a
float32 and a bfloat16 group mirrors every finished request to the other group, /metrics shows the
pairs' windows, a burst overflows a one-job queue into the dropped counter, and telemetry's
Alerts stream carries the SHADOW_DIVERGENCE alert naming the candidate."""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from services.common.errors import InvalidArgument, Unavailable
from services.common.group_status import GroupStatus
from services.common.proto import telemetry_pb2
from services.quality.comparison import compare
from services.quality.shadow_window import ShadowWindow
from services.router.replicas import ReplicaSet
from services.router.shadow import ShadowConfig, ShadowJob, ShadowMirror, generated_positions
from services.telemetry.rules import Alert, AlertKind
from tests.router.processes import running_up
from tests.router.test_quantized_groups import group_dtypes
from tests.router.test_up import up_command
from tests.telemetry.procs import alerts_reader, scrape, wait_until


@dataclass
class Chunk:
    logprobs: list[float]
    argmax: list[int]


@dataclass
class Answer:
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


# ---- the window ----------------------------------------------------------------------------


def test_window_figures_are_the_golden_set_comparisons_on_the_mirrored_tokens():
    rng = random.Random(7)
    window = ShadowWindow(10_000)
    ref_chunks, cand_chunks = [], []
    for _ in range(5):
        n = rng.randrange(3, 40)
        tokens = [rng.randrange(50) for _ in range(n)]
        inc = [-rng.random() * 4 for _ in range(n)]
        cand = [lp + rng.gauss(0, 0.1) for lp in inc]
        cand_argmax = [t if rng.random() < 0.9 else t + 1 for t in tokens]
        window.add(inc, cand, [a == t for a, t in zip(cand_argmax, tokens)])
        ref_chunks.append(Chunk(inc, tokens))  # greedy: the incumbent's token is its argmax
        cand_chunks.append(Chunk(cand, cand_argmax))
    expected = compare(ref_chunks, cand_chunks)
    got = window.figures()
    assert got.tokens == got.greedy_tokens == expected.scored_tokens
    assert got.perplexity_delta_pct == pytest.approx(expected.perplexity_delta_pct, rel=1e-12)
    assert got.mean_abs_logprob_delta == pytest.approx(expected.mean_abs_logprob_delta, rel=1e-12)
    assert got.top1_agreement == pytest.approx(expected.top1_agreement, rel=1e-12)
    assert got.incumbent_perplexity == pytest.approx(expected.reference_perplexity, rel=1e-12)
    assert got.candidate_perplexity == pytest.approx(expected.candidate_perplexity, rel=1e-12)


def test_window_keeps_the_newest_positions_and_counts_top1_on_greedy_ones_only():
    window = ShadowWindow(4)
    assert window.figures() is None
    window.add([-1.0, -1.0], [-2.0, -2.0])  # sampled: no top-1 figure
    first = window.figures()
    assert first.tokens == 2 and first.greedy_tokens == 0 and math.isnan(first.top1_agreement)
    assert first.mean_abs_logprob_delta == 1.0
    assert first.perplexity_delta_pct == pytest.approx(100 * (math.e - 1))
    window.add([-0.5, -0.5, -0.5], [-0.5, -0.5, -0.7], [True, False, True])
    f = window.figures()  # the oldest position went: one sampled, three greedy left
    assert (f.tokens, f.greedy_tokens, f.top1_agreement) == (4, 3, pytest.approx(2 / 3))
    assert f.mean_abs_logprob_delta == pytest.approx((1.0 + 0.2) / 4)
    assert f.perplexity_delta_pct == pytest.approx(100 * (math.exp((1.0 + 0.2) / 4) - 1))
    with pytest.raises(ValueError):
        window.add([-1.0], [-1.0, -2.0])


def test_the_running_sums_are_the_sums_of_the_positions_in_the_window():
    rng = random.Random(11)
    window = ShadowWindow(97)
    kept: list[tuple[float, float, bool | None]] = []
    for _ in range(60):
        n = rng.randrange(1, 30)
        inc = [-rng.random() * 8 for _ in range(n)]
        cand = [lp - rng.random() for lp in inc]
        flags = [rng.random() < 0.8 for _ in range(n)] if rng.random() < 0.5 else None
        window.add(inc, cand, flags)
        kept = (kept + list(zip(inc, cand, flags or [None] * n)))[-97:]
        fresh = ShadowWindow(10_000)
        for i, c, f in kept:
            fresh.add([i], [c], None if f is None else [f])
        got, want = window.figures(), fresh.figures()
        assert (got.tokens, got.greedy_tokens) == (want.tokens, want.greedy_tokens) == (len(kept), got.greedy_tokens)
        assert got.perplexity_delta_pct == pytest.approx(want.perplexity_delta_pct, rel=1e-9, abs=1e-9)
        assert got.mean_abs_logprob_delta == pytest.approx(want.mean_abs_logprob_delta, rel=1e-9)
        assert (math.isnan(got.top1_agreement) and math.isnan(want.top1_agreement)) or \
            got.top1_agreement == pytest.approx(want.top1_agreement)


def test_the_generated_tokens_logprobs_are_read_at_the_positions_that_predict_them():
    job = ShadowJob("r", "m", "rg-a", (5, 6, 7), (8, 9), (-0.1, -0.2), True)
    # the candidate scored 5 ids: position i predicts id i+1; ids 8 and 9 are predicted at 2 and 3
    answer = Answer([-1.0, -2.0, -3.0, -4.0], [[(1, -0.5)], [(2, -0.5)], [(8, -0.1)], [(4, -0.2)]])
    assert generated_positions(job, answer) == ([-3.0, -4.0], [8, 4])
    with pytest.raises(ValueError):
        generated_positions(job, Answer([-1.0, -2.0], [[], []]))


def test_bad_settings_are_refused_with_their_values():
    for bad in (dict(fraction=1.5), dict(queue_size=0), dict(window_tokens=10, min_tokens=11),
                dict(threshold_pct=-1.0), dict(threshold_pct=math.nan)):
        with pytest.raises(InvalidArgument):
            ShadowConfig(**bad)


# ---- the mirror (a plain function stands in for the candidates' Score) ------------------


def replica_set(*groups: tuple[str, str, str]) -> ReplicaSet:
    """Routable groups (id, model, dtype), each at address ``addr-ID``."""
    replicas = ReplicaSet()
    for gid, model, dtype in groups:
        view, _ = replicas.add(f"addr-{gid}")
        view.replica_group_id, view.model, view.dtype, view.tp_degree, view.pp_degree = gid, model, dtype, 1, 1
        view.status, view.routable = GroupStatus.HEALTHY, True
    return replicas


class Scorer:
    """Each group's answer: the incumbent's logprobs shifted by ``shift[address]`` (prompt
    positions: -1 shifted the same way), argmax the incumbent's token; a Score of the prompt alone
    is the incumbent's; raises for an address in ``failing``."""

    def __init__(self, shift: dict[str, float], failing: tuple[str, ...] = ()) -> None:
        self.shift, self.failing, self.calls = shift, failing, []
        self.jobs: dict[tuple[int, ...], ShadowJob] = {}
        self.prompts: set[tuple[int, ...]] = set()

    def __call__(self, address, request_id, ids, top, timeout_s):
        self.calls.append((address, request_id, top))
        if address in self.failing:
            raise Unavailable(f"worker {address} is down")
        if tuple(ids) in self.prompts:  # the incumbent scoring the prompt
            lps = [-1.0 + self.shift.get(address, 0.0)] * (len(ids) - 1)
            return Answer(lps, [[] for _ in lps])
        job = self.jobs[tuple(ids)]
        lead = [-1.0 + self.shift[address]] * (len(job.prompt_ids) - 1)
        lps = lead + [lp + self.shift[address] for lp in job.incumbent_logprobs]
        return Answer(lps, [[(t, lp)] for t, lp in zip([0] * len(lead) + list(job.generated_ids), lps)])


def job_of(scorer: Scorer, incumbent: str, n: int, seed: int, greedy: bool = True, prompt_len: int = 3) -> ShadowJob:
    rng = random.Random(seed)
    job = ShadowJob(f"req-{seed}", "m", incumbent, tuple(range(1, prompt_len + 1)),
                    tuple(rng.randrange(100) for _ in range(n)), tuple(-rng.random() for _ in range(n)), greedy)
    scorer.jobs[(*job.prompt_ids, *job.generated_ids)] = job
    scorer.prompts.add(job.prompt_ids)
    return job


def test_candidates_are_the_other_plans_of_the_model_or_the_named_groups():
    replicas = replica_set(("rg-a", "m", "bfloat16"), ("rg-b", "m", "int8"), ("rg-c", "m", "bfloat16"),
                           ("rg-d", "other", "int8"))
    scorer = Scorer({"addr-rg-b": 0.0, "addr-rg-c": 0.0})
    mirror = ShadowMirror(ShadowConfig(fraction=1.0), replicas, scorer)
    job = job_of(scorer, "rg-a", 4, 1)
    assert mirror.candidates(job) == [("rg-b", "addr-rg-b")]  # rg-c: same plan; rg-d: another model
    named = ShadowMirror(ShadowConfig(fraction=1.0, candidate_group_ids=("rg-a", "rg-c", "rg-d", "rg-x")),
                         replicas, scorer)
    assert named.candidates(job) == [("rg-c", "addr-rg-c")]  # the incumbent itself is left out
    assert named.skipped == 2  # rg-d serves another model, rg-x is unknown


def test_a_full_queue_drops_and_counts_without_blocking():
    mirror = ShadowMirror(ShadowConfig(fraction=1.0, queue_size=2), replica_set(), Scorer({}))  # not started
    job = ShadowJob("r", "m", "rg-a", (1,), (2,), (-0.1,), True)
    started = time.perf_counter()
    accepted = [mirror.offer(job) for _ in range(5)]
    assert time.perf_counter() - started < 0.1
    assert accepted == [True, True, False, False, False]
    assert (mirror.offered, mirror.dropped, mirror.queue_depth) == (5, 3, 2)


def test_the_fraction_picks_requests_by_the_seeded_draw():
    picks = [ShadowMirror(ShadowConfig(fraction=0.25, seed=3), replica_set(), Scorer({})) for _ in range(2)]
    draws = [[m.wants() for _ in range(2000)] for m in picks]
    assert draws[0] == draws[1] and 0.2 < sum(draws[0]) / 2000 < 0.3


def test_a_divergent_candidate_is_alerted_once_until_its_window_goes_back_under():
    replicas = replica_set(("rg-a", "m", "bfloat16"), ("rg-b", "m", "int8"))
    scorer = Scorer({"addr-rg-b": -0.05})  # 5 % worse perplexity: exp(0.05) - 1
    alerts: list[Alert] = []
    config = ShadowConfig(fraction=1.0, window_tokens=100, min_tokens=50, threshold_pct=1.0, judge="generated")
    mirror = ShadowMirror(config, replicas, scorer, raise_alert=alerts.append)
    for seed in range(2):
        mirror.process(job_of(scorer, "rg-a", 20, seed))
    assert not alerts  # 40 tokens: below min_tokens
    for seed in range(2, 6):
        mirror.process(job_of(scorer, "rg-a", 20, seed))
    assert len(alerts) == 1  # once, though every later job is over the threshold too
    alert = alerts[0]
    assert alert.kind is AlertKind.SHADOW_DIVERGENCE and alert.replica_group_id == "rg-b"
    assert alert.reference == "rg-a" and alert.threshold_pct == 1.0
    assert alert.perplexity_delta_pct == pytest.approx(100 * (math.exp(0.05) - 1))
    assert "+5.127 %" in alert.message and "rg-a" in alert.message
    figures = mirror.windows()[("rg-a", "rg-b")]
    assert figures.tokens == 100 and figures.top1_agreement == 1.0
    scorer.shift["addr-rg-b"] = 0.0  # the candidate is fixed: five clean jobs fill the window
    for seed in range(6, 11):
        mirror.process(job_of(scorer, "rg-a", 20, seed))
    assert len(alerts) == 1 and mirror.windows()[("rg-a", "rg-b")].perplexity_delta_pct == pytest.approx(0, abs=1e-9)
    scorer.shift["addr-rg-b"] = -0.05  # diverges again: a second alert
    for seed in range(11, 16):
        mirror.process(job_of(scorer, "rg-a", 20, seed))
    assert len(alerts) == 2 and mirror.compared == 16


def test_a_failed_score_or_telemetry_down_is_counted_and_the_mirror_goes_on():
    replicas = replica_set(("rg-a", "m", "bfloat16"), ("rg-b", "m", "int8"), ("rg-c", "m", "fp8"))
    scorer = Scorer({"addr-rg-b": -0.05}, failing=("addr-rg-c",))

    def telemetry_down(alert: Alert) -> None:
        raise grpc.RpcError("telemetry unreachable")

    mirror = ShadowMirror(ShadowConfig(fraction=1.0, min_tokens=10, threshold_pct=1.0, judge="generated"), replicas,
                          scorer, raise_alert=telemetry_down).start()
    try:
        for seed in range(3):
            assert mirror.offer(job_of(scorer, "rg-a", 10, seed, greedy=False))
        assert wait_until(mirror.idle, 10) and wait_until(lambda: mirror.compared == 3, 10)
    finally:
        mirror.stop()
    assert (mirror.compared, mirror.failed) == (3, 3)
    assert mirror.alerts_failed == 1 and mirror.alerts_raised == 0  # retried only after ALERT_RETRY_S
    figures = mirror.windows()[("rg-a", "rg-b")]
    assert figures.greedy_tokens == 0 and math.isnan(figures.top1_agreement)
    assert [c[2] for c in scorer.calls] == [1] * 6 and scorer.calls[0][1] == "shadow-req-0"


def test_the_prompt_window_scores_the_prompt_on_both_groups_and_is_what_is_judged():
    replicas = replica_set(("rg-a", "m", "bfloat16"), ("rg-b", "m", "int8"))
    scorer = Scorer({"addr-rg-a": 0.0, "addr-rg-b": -0.05})
    alerts: list[Alert] = []
    mirror = ShadowMirror(ShadowConfig(fraction=1.0, window_tokens=200, min_tokens=50, threshold_pct=1.0), replicas,
                          scorer, raise_alert=alerts.append)
    mirror.process(job_of(scorer, "rg-a", 4, 0, prompt_len=30))
    assert not alerts and mirror.prompt_windows()[("rg-a", "rg-b")].tokens == 29  # below min_tokens
    assert ("addr-rg-a", "shadow-req-0-incumbent", 0) in scorer.calls  # the incumbent scored the prompt
    mirror.process(job_of(scorer, "rg-a", 4, 1, prompt_len=30))
    prompt = mirror.prompt_windows()[("rg-a", "rg-b")]
    assert prompt.tokens == 58 and prompt.perplexity_delta_pct == pytest.approx(100 * (math.exp(0.05) - 1))
    assert len(alerts) == 1 and "58 mirrored prompt positions" in alerts[0].message  # the generated window: 8
    assert mirror.windows()[("rg-a", "rg-b")].tokens == 8
    scorer.failing = ("addr-rg-a",)  # the incumbent cannot score: the generated window is still fed
    mirror.process(job_of(scorer, "rg-a", 4, 2, prompt_len=30))
    assert mirror.prompt_windows()[("rg-a", "rg-b")].tokens == 58 and mirror.windows()[("rg-a", "rg-b")].tokens == 12
    with pytest.raises(InvalidArgument, match="--shadow-judge"):
        ShadowConfig(judge="both")


def test_a_job_waits_for_its_groups_to_be_idle_and_is_dropped_when_they_stay_busy():
    replicas = replica_set(("rg-a", "m", "bfloat16"), ("rg-b", "m", "int8"))
    scorer = Scorer({"addr-rg-a": 0.0, "addr-rg-b": -0.05})
    mirror = ShadowMirror(ShadowConfig(fraction=1.0, idle_wait_s=0.2), replicas, scorer)
    replicas.by_group_id("rg-b").kv_bytes_reserved = 4096  # a request of ours is decoding on the candidate
    started = time.monotonic()
    mirror.process(job_of(scorer, "rg-a", 4, 0, prompt_len=10))
    assert time.monotonic() - started >= 0.2 and not scorer.calls  # nothing was scored on a busy group
    assert (mirror.dropped, mirror.busy, mirror.compared) == (1, 1, 0)
    replicas.by_group_id("rg-b").kv_bytes_reserved = 0
    mirror.process(job_of(scorer, "rg-a", 4, 1, prompt_len=10))
    assert mirror.compared == 1 and mirror.dropped == 1
    with pytest.raises(InvalidArgument, match="--shadow-idle-wait"):
        ShadowConfig(idle_wait_s=-1.0)


# ---- end to end: `shardline up` with two plans -------------------------------------------


def metric(samples: dict, name: str, **labels: str) -> list[tuple[dict, float]]:
    return [(lab, v) for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items())]


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for _, v in metric(samples, name, **labels))


@pytest.fixture(scope="module")
def shadow_stack(tmp_path_factory):
    """`up --replicas 2` with a float32 and a bfloat16 group of the tiny model, every finished
    request mirrored (queue of one), judged from 32 tokens with a zero threshold."""
    tmp = tmp_path_factory.mktemp("shadow")
    argv, env, ports = up_command(tmp, "--replicas", "2", "--dtype", "float32,bfloat16", "--shadow-fraction", "1",
                                  "--shadow-queue", "1", "--shadow-min-tokens", "32", "--shadow-threshold-pct", "0")
    with running_up(argv, env, tmp / "up.out"):
        http = f"http://127.0.0.1:{ports['http']}"
        telemetry = f"127.0.0.1:{ports['base']}"
        alerts, _, channel = alerts_reader(telemetry, "")
        try:
            served = []
            for i in range(8):  # one at a time, each mirrored before the next: the queue never overflows
                served.append(complete(http, i))
                settled(http, i + 1)
            yield {"http": http, "router": f"127.0.0.1:{ports['router']}", "alerts": alerts, "served": served,
                   "logs": tmp / "logs"}
        finally:
            channel.close()


def complete(http: str, i: int, max_tokens: int = 16) -> str:
    response = httpx.post(f"{http}/v1/completions", json={
        "model": "tiny-llama", "prompt": f"shadow story {i}: the quick brown fox jumps over the lazy dog",
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert response.status_code == 200, response.text
    return response.headers["x-shardline-replica-group-id"]


def settled(http: str, requests: int) -> dict:
    """/metrics once every one of ``requests`` mirrored requests has an outcome or was dropped."""
    def done() -> dict | None:
        samples = scrape(f"{http}/metrics")
        outcomes = total(samples, "shardline_shadow_requests_total") + total(samples, "shardline_shadow_dropped_total")
        return samples if outcomes >= requests else None
    samples = wait_until(done, 20)
    assert samples, scrape(f"{http}/metrics").get("shardline_shadow_requests_total")
    return samples


@pytest.mark.slow
def test_up_mirrors_finished_requests_and_exports_each_pairs_window(shadow_stack):
    samples = settled(shadow_stack["http"], 8)
    dtypes = group_dtypes(shadow_stack["router"])
    assert set(dtypes.values()) == {"DTYPE_FLOAT32", "DTYPE_BFLOAT16"}
    compared = metric(samples, "shardline_shadow_requests_total", outcome="compared")
    assert sum(v for _, v in compared) == 8 and total(samples, "shardline_shadow_dropped_total") == 0
    for labels, count in compared:
        inc, cand = labels["incumbent"], labels["candidate"]
        assert {inc, cand} == set(dtypes) and count == shadow_stack["served"].count(inc)
        assert total(samples, "shardline_shadow_tokens_total", incumbent=inc, candidate=cand) == 16 * count
        for gauge in ("shardline_shadow_perplexity_delta_pct", "shardline_shadow_mean_abs_logprob_delta",
                      "shardline_shadow_top1_agreement", "shardline_shadow_prompt_perplexity_delta_pct",
                      "shardline_shadow_prompt_mean_abs_logprob_delta"):
            (_, value), = metric(samples, gauge, incumbent=inc, candidate=cand)
            assert math.isfinite(value), gauge
        assert 0 < total(samples, "shardline_shadow_mean_abs_logprob_delta", incumbent=inc, candidate=cand) < 5
        assert 0 <= total(samples, "shardline_shadow_top1_agreement", incumbent=inc, candidate=cand) <= 1


@pytest.mark.slow
def test_a_window_past_the_threshold_alerts_on_its_candidate(shadow_stack):
    samples = settled(shadow_stack["http"], 8)
    judged = {(lab["incumbent"], lab["candidate"]): v for lab, v in
              metric(samples, "shardline_shadow_prompt_window_tokens") if v >= 32}  # judged on the prompts
    assert judged, samples.get("shardline_shadow_prompt_window_tokens")
    alerts = wait_until(lambda: [a for a in shadow_stack["alerts"]
                                 if a.kind == telemetry_pb2.ALERT_KIND_SHADOW_DIVERGENCE], 10)
    assert alerts, (shadow_stack["logs"] / "router.log").read_text()[-3000:]
    assert {(a.reference, a.replica_group_id) for a in alerts} == set(judged)  # once per pair
    for alert in alerts:  # its figures are the window's when it crossed (the window has grown since)
        assert alert.threshold_pct == 0.0 and abs(alert.perplexity_delta_pct) > 0
        assert f"{alert.perplexity_delta_pct:+.3f} %" in alert.message
    assert total(samples, "shardline_shadow_alerts_total", outcome="raised") == len(judged)


@pytest.mark.slow
def test_a_burst_overflows_the_queue_into_the_dropped_counter(shadow_stack):
    before = settled(shadow_stack["http"], 8)
    start = total(before, "shardline_shadow_requests_total") + total(before, "shardline_shadow_dropped_total")
    with ThreadPoolExecutor(12) as pool:
        list(pool.map(lambda i: complete(shadow_stack["http"], 100 + i, max_tokens=8), range(12)))
    samples = settled(shadow_stack["http"], start + 12)
    dropped = total(samples, "shardline_shadow_dropped_total")
    outcomes = total(samples, "shardline_shadow_requests_total")
    assert dropped >= 1 and outcomes + dropped == start + 12  # every finished request: mirrored or dropped
    # the last job's outcome is counted just before the mirror marks it done: poll for the empty queue
    wait_until(lambda: total(scrape(f"{shadow_stack['http']}/metrics"), "shardline_shadow_queue_depth") == 0, 5)
    assert total(scrape(f"{shadow_stack['http']}/metrics"), "shardline_shadow_queue_depth") == 0


def test_up_passes_the_shadow_flags_and_a_dtype_per_group_on():
    import argparse

    from services.cli.up import group_dtypes as up_group_dtypes
    from services.cli.up import register, router_flags

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["up", "--replicas", "2", "--dtype", "bfloat16,int8", "--shadow-fraction", "0.5",
                              "--shadow-group", "rg-x", "--shadow-group", "rg-y", "--shadow-threshold-pct", "1.5"])
    assert up_group_dtypes(args) == ["bfloat16", "int8"]
    flags = router_flags(args, Path("/m"), "sqlite:///r.db", ["http://t/metrics"], "127.0.0.1:50051")
    assert flags[flags.index("--telemetry") + 1] == "127.0.0.1:50051"
    assert flags[flags.index("--shadow-fraction"):] == ["--shadow-fraction", "0.5", "--shadow-threshold-pct", "1.5",
                                                         "--shadow-group", "rg-x", "--shadow-group", "rg-y"]
    args.dtype = "bfloat16,int8,fp8"
    with pytest.raises(InvalidArgument):
        up_group_dtypes(args)
