"""Shadow traffic bench: the live window's perplexity delta next to `shardline gate`'s, and what
mirroring costs the clients.

``python -m bench.shadow [--requests 200] [--rounds 6] [--streams 4] [--per-stream 4] [--fraction 1]
[--chunks 32]``

SmolLM2-135M (the float32 conversion ``bench.quant`` uses) served by ``shardline up --replicas 2
--dtype bfloat16,int8 --shadow-fraction F`` (``--fraction``, default 1: every finished request is
mirrored to the other group). A second router (``shardline serve router``, no shadowing) fronts the same two workers, so
that shadowing on and off see the same groups, the same requests and the same machine:

1. client TPOT, on vs off, in paired rounds whose order alternates (on/off, off/on, ...): each
   round is ``--streams`` client threads sending ``--per-stream`` greedy streamed completions back
   to back through the router's gRPC ``Generate``, with max_tokens drawn per request from a
   generator seeded by the round (both routers of a round get the same requests; the lengths
   differ, so requests finish at different times and the mirror's Scores overlap the round's own
   decoding). After a round the mirror is let drain, so that an "off" round never pays for the
   "on" round before it. Per round: the median TPOT of its streams; per pair of rounds: on / off.
2. more requests through the shadowing router until the pair (incumbent bfloat16, candidate int8)
   has ``--requests`` compared requests; its window covers all of them (``--shadow-window-tokens``
   is set to hold them), and the reverse pair's figures are reported too.
3. ``shardline gate --reference worker=<bfloat16> --candidate worker=<int8>`` on the golden set
   (``--chunks`` × 512 tokens) through the same two workers' Score: its delta and 95 % interval.

Each pair has two windows: the prompts' positions, scored by both groups (natural prose, like the
golden set: its delta is the one compared with the gate's interval, and the one alerts are judged
on), and the generated positions, the incumbent's own greedy tokens, on which the incumbent's
logprobs are high by construction, so that window's delta reads above the gate's either way.

Writes bench/results/shadow.json and shadow.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import machine, smollm2_dir, write_results
from bench.soak import Stack, ports_for
from services.common.ports import free_port
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from services.quality.comparison import percentile
from services.quality.golden_set import golden_text

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("bfloat16", "int8")  # incumbent, candidate
PASSAGE_CHARS = 1200


def prompts(kind: str = "golden") -> list[str]:
    """The clients' prompts. ``golden``: consecutive ~1,200-character passages (about 256 tokens)
    of the golden set's own text, so that the prompt window measures the gate's kind of text at a
    context of a few hundred tokens; ``openings``: the first 160 characters of each paragraph of
    the same reference prose (short contexts, where each position has seen little)."""
    if kind == "golden":
        text = golden_text()
        return [text[i:i + PASSAGE_CHARS] for i in range(0, len(text) - PASSAGE_CHARS, PASSAGE_CHARS)]
    out = []
    for text in topics.values():
        for para in text.split("\n\n"):
            para = " ".join(para.split())
            if len(para) > 80 and not para.startswith((">>>", "...")):
                out.append(para[:160])
    return out


def scrape(http: str) -> dict[str, list[tuple[dict, float]]]:
    text = httpx.get(f"{http}/metrics", timeout=10).text
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def pair_value(samples: dict, name: str, incumbent: str, candidate: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if lab.get("incumbent") == incumbent
               and lab.get("candidate") == candidate and all(lab.get(k) == w for k, w in labels.items()))


def settled_total(samples: dict) -> float:
    return sum(v for _, v in samples.get("shardline_shadow_requests_total", [])) + sum(
        v for _, v in samples.get("shardline_shadow_dropped_total", []))


def wait_drained(http: str, timeout_s: float = 300.0) -> None:
    """Until the shadow mirror has nothing queued or being scored (twice in a row: a request's job
    is offered just after its stream has ended)."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 2:
        time.sleep(0.25)
        depth = sum(v for _, v in scrape(http).get("shardline_shadow_queue_depth", []))
        quiet = quiet + 1 if depth == 0 else 0
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shadow mirror did not drain within {timeout_s:.0f} s")


def stream_tpot(stub, model: str, prompt: str, max_tokens: int) -> float:
    """One greedy streamed completion; its TPOT in seconds (first to last token over n - 1)."""
    request = router_pb2.RouterGenerateRequest(model=model, text=prompt, sampling=common_pb2.SamplingParameters(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    times = [time.perf_counter() for r in stub.Generate(request, timeout=300) if r.HasField("token")]
    if len(times) < 2:
        raise RuntimeError(f"a stream of {len(times)} tokens has no TPOT")
    return (times[-1] - times[0]) / (len(times) - 1)


def run_round(router: str, model: str, texts: list[str], *, seed: int, streams: int, per_stream: int,
              max_tokens: tuple[int, int]) -> list[float]:
    """``streams`` client threads, ``per_stream`` requests each; every stream's TPOT."""
    rng = random.Random(seed)
    plan = [[(rng.choice(texts), rng.randint(*max_tokens)) for _ in range(per_stream)] for _ in range(streams)]
    tpots: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    with grpc.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)

        def client(requests: list[tuple[str, int]]) -> None:
            try:
                for text, n in requests:
                    tpot = stream_tpot(stub, model, text, n)
                    with lock:
                        tpots.append(tpot)
            except BaseException as exc:  # noqa: BLE001 - reported after the round
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(p,)) for p in plan]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} client streams failed: {errors[0]}")
    return tpots


def groups(router: str) -> dict[str, dict[str, str]]:
    with grpc.insecure_channel(router) as channel:
        found = router_pb2_grpc.RouterServiceStub(channel).ListReplicaGroups(
            router_pb2.ListReplicaGroupsRequest(), timeout=10).groups
    return {common_pb2.Dtype.Name(g.layout.dtype).removeprefix("DTYPE_").lower(): {
        "id": g.replica_group_id, "address": g.address} for g in found}


def start_plain_router(model_dir: Path, workers: list[str], workdir: Path) -> tuple[subprocess.Popen, str]:
    port, http_port = free_port(), free_port()
    argv = [sys.executable, "-m", "services.cli", "serve", "router", "--port", str(port), "--http-port",
            str(http_port), "--model", str(model_dir)]
    for address in workers:
        argv += ["--worker", address]
    log = (workdir / "plain-router.log").open("wb")
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5).status_code == 200:
                return proc, f"127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the plain router did not start: {(workdir / 'plain-router.log').read_text()[-2000:]}")
        time.sleep(0.25)


def run_gate(model_dir: Path, reference: str, candidate: str, chunks: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "services.cli", "gate", "--model", str(model_dir), "--reference",
            f"worker={reference}", "--candidate", f"worker={candidate}", "--chunks", str(chunks), "--json",
            "--no-record"]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"shardline gate exited {done.returncode}: {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    out["seconds"] = time.perf_counter() - started
    return out


def paired(on: list[float], off: list[float], *, samples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Per-pair ratios on / off of the rounds' median TPOTs: their median and a 95 % percentile
    bootstrap interval of the mean ratio over pairs."""
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    rng = random.Random(seed)
    means = [statistics.fmean(rng.choice(ratios) for _ in ratios) for _ in range(samples)]
    return {"ratios": ratios, "median_ratio": statistics.median(ratios), "mean_ratio": statistics.fmean(ratios),
            "mean_ratio_interval": [percentile(means, 2.5), percentile(means, 97.5)]}


def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model_dir = smollm2_dir()
    texts = prompts(args.prompts)
    lengths = (args.min_tokens, args.max_tokens)
    window = max(4096, 4 * args.requests * args.max_tokens)  # holds every compared request of the pair
    ports = ports_for(None, 2)
    stack = Stack(str(model_dir), 2, ports, workdir, [
        "--dtype", ",".join(DTYPES), "--kv-cache-gb", "0.1", "--shadow-fraction", str(args.fraction),
        "--shadow-window-tokens", str(window), "--shadow-min-tokens", "1", "--shadow-threshold-pct", "1000"])
    plain = None
    try:
        startup_s = stack.start(timeout_s=900)
        shadow_router, http = f"127.0.0.1:{ports['router']}", f"http://127.0.0.1:{ports['http']}"
        found = groups(shadow_router)
        incumbent, candidate = found[DTYPES[0]], found[DTYPES[1]]
        plain, plain_router = start_plain_router(model_dir, [g["address"] for g in found.values()], workdir)
        model = stack.model_name()
        run_round(shadow_router, model, texts, seed=-1, streams=2, per_stream=1, max_tokens=(4, 4))  # warm-up
        run_round(plain_router, model, texts, seed=-1, streams=2, per_stream=1, max_tokens=(4, 4))
        wait_drained(http)
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            row: dict[str, Any] = {"order": list(order)}
            for which in order:
                tpots = run_round(shadow_router if which == "on" else plain_router, model, texts, seed=r,
                                  streams=args.streams, per_stream=args.per_stream, max_tokens=lengths)
                if which == "on":
                    wait_drained(http)
                row[which] = {"median_tpot_ms": statistics.median(tpots) * 1e3, "streams": len(tpots)}
            rounds.append(row)
            print(f"round {r}: on {row['on']['median_tpot_ms']:.2f} ms, off {row['off']['median_tpot_ms']:.2f} ms",
                  flush=True)
        # top up the pair (bfloat16 -> int8) to the requested count of mirrored requests
        extra = 0
        while pair_value(scrape(http), "shardline_shadow_requests_total", incumbent["id"], candidate["id"],
                         outcome="compared") < args.requests:
            run_round(shadow_router, model, texts, seed=10_000 + extra, streams=args.streams, per_stream=2,
                             max_tokens=lengths)
            extra += 1
            wait_drained(http)
            if extra > 10 * args.requests:
                raise RuntimeError("the bfloat16 group gets no mirrored traffic")
        samples = scrape(http)
        pairs = {}
        for name, inc, cand in (("bfloat16->int8", incumbent, candidate), ("int8->bfloat16", candidate, incumbent)):
            pairs[name] = {
                "compared": pair_value(samples, "shardline_shadow_requests_total", inc["id"], cand["id"],
                                       outcome="compared"),
                "failed": pair_value(samples, "shardline_shadow_requests_total", inc["id"], cand["id"],
                                     outcome="failed"),
                "tokens": pair_value(samples, "shardline_shadow_tokens_total", inc["id"], cand["id"]),
                "window_tokens": pair_value(samples, "shardline_shadow_window_tokens", inc["id"], cand["id"]),
                "perplexity_delta_pct": pair_value(samples, "shardline_shadow_perplexity_delta_pct", inc["id"],
                                                   cand["id"]),
                "mean_abs_logprob_delta": pair_value(samples, "shardline_shadow_mean_abs_logprob_delta", inc["id"],
                                                     cand["id"]),
                "top1_agreement": pair_value(samples, "shardline_shadow_top1_agreement", inc["id"], cand["id"]),
                "prompt_window_tokens": pair_value(samples, "shardline_shadow_prompt_window_tokens", inc["id"],
                                                   cand["id"]),
                "prompt_perplexity_delta_pct": pair_value(samples, "shardline_shadow_prompt_perplexity_delta_pct",
                                                          inc["id"], cand["id"]),
                "prompt_mean_abs_logprob_delta": pair_value(
                    samples, "shardline_shadow_prompt_mean_abs_logprob_delta", inc["id"], cand["id"])}
        dropped = sum(v for _, v in samples.get("shardline_shadow_dropped_total", []))
        mirrored = settled_total(samples)
        gate = run_gate(model_dir, incumbent["address"], candidate["address"], args.chunks)
    finally:
        if plain is not None:
            plain.terminate()
            plain.wait(timeout=30)
        stack.stop()
    on = [r["on"]["median_tpot_ms"] for r in rounds]
    off = [r["off"]["median_tpot_ms"] for r in rounds]
    prompt_delta = pairs["bfloat16->int8"]["prompt_perplexity_delta_pct"]
    generated_delta = pairs["bfloat16->int8"]["perplexity_delta_pct"]
    low, high = gate["delta_interval_pct"]
    return {"model": str(model_dir), "dtypes": {"incumbent": DTYPES[0], "candidate": DTYPES[1]},
            "startup_s": startup_s, "settings": {k: v for k, v in vars(args).items()}, "shadow_window_tokens": window,
            "pairs": pairs, "dropped": dropped, "mirrored_total": mirrored,
            "gate": {k: gate.get(k) for k in ("perplexity_delta_pct", "delta_interval_pct", "scored_tokens",
                                              "mean_abs_logprob_delta", "top1_agreement", "passed", "seconds")},
            "shadow_delta_in_gate_interval": low <= prompt_delta <= high,  # the judged (prompt) window
            "generated_delta_in_gate_interval": low <= generated_delta <= high,
            "tpot": {"rounds": rounds, "on_median_ms": statistics.median(on), "off_median_ms": statistics.median(off),
                     **paired(on, off)}}


def markdown(p: dict[str, Any]) -> str:
    s, g, t = p["settings"], p["gate"], p["tpot"]
    lines = ["# Shadow traffic: live window vs the golden-set gate, and client TPOT on vs off", "",
             f"Machine: {p['machine']}. Command: `{p['command']}`. SmolLM2-135M, `shardline up --replicas 2 --dtype "
             f"bfloat16,int8 --shadow-fraction {s['fraction']:g}` (incumbent bfloat16, candidate int8); a second "
             f"router without shadowing fronts the same workers.", "",
             "| pair (incumbent -> candidate) | compared requests | prompt positions | prompt perplexity Δ "
             "| prompt mean abs Δlogprob | generated positions | generated perplexity Δ | generated mean abs "
             "Δlogprob | top-1 agreement (greedy) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, d in p["pairs"].items():
        lines.append(f"| {name} | {d['compared']:.0f} | {d['prompt_window_tokens']:.0f} "
                     f"| {d['prompt_perplexity_delta_pct']:+.3f} % | {d['prompt_mean_abs_logprob_delta']:.4f} "
                     f"| {d['window_tokens']:.0f} | {d['perplexity_delta_pct']:+.3f} % "
                     f"| {d['mean_abs_logprob_delta']:.4f} | {d['top1_agreement']:.4f} |")
    lo, hi = g["delta_interval_pct"]
    lines += ["", f"`shardline gate --reference worker=<bfloat16> --candidate worker=<int8>` on {g['scored_tokens']} "
                  f"golden-set positions ({s['chunks']} chunks): perplexity Δ {g['perplexity_delta_pct']:+.3f} % "
                  f"(95 % interval {lo:+.3f} .. {hi:+.3f} %), mean abs Δlogprob {g['mean_abs_logprob_delta']:.4f}, "
                  f"top-1 {g['top1_agreement']:.4f}. The prompt window's bfloat16 -> int8 delta (the one alerts are "
                  f"judged on) is {'inside' if p['shadow_delta_in_gate_interval'] else 'OUTSIDE'} that interval; the "
                  f"generated window's is {'inside' if p['generated_delta_in_gate_interval'] else 'outside'} (it "
                  f"scores the incumbent's own greedy tokens, which favour the incumbent). Dropped by a full shadow "
                  f"queue: "
                  f"{p['dropped']:.0f} of {p['mirrored_total']:.0f} picked.", "",
              f"Client TPOT, {len(t['rounds'])} paired rounds (order alternating), each {s['streams']} streams x "
              f"{s['per_stream']} greedy completions of {s['min_tokens']}-{s['max_tokens']} tokens after "
              f"{s['prompts']} prompts:", "",
              "| round | order | TPOT on (ms) | TPOT off (ms) | on / off |", "|---|---|---|---|---|"]
    for i, (r, ratio) in enumerate(zip(t["rounds"], t["ratios"])):
        lines.append(f"| {i} | {'/'.join(r['order'])} | {r['on']['median_tpot_ms']:.2f} | "
                     f"{r['off']['median_tpot_ms']:.2f} | {ratio:.3f} |")
    lo, hi = t["mean_ratio_interval"]
    lines += ["", f"Paired on / off: median {t['median_ratio']:.3f}, mean {t['mean_ratio']:.3f} (95 % bootstrap "
                  f"interval {lo:.3f} .. {hi:.3f}); medians over rounds {t['on_median_ms']:.2f} vs "
                  f"{t['off_median_ms']:.2f} ms."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shadow", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="mirrored requests of the pair (default 200)")
    parser.add_argument("--rounds", type=int, default=6, help="paired TPOT rounds (default 6)")
    parser.add_argument("--prompts", choices=("golden", "openings"), default="golden",
                        help="the clients' prompts: passages of the golden text (default) or paragraph openings")
    parser.add_argument("--streams", type=int, default=4, help="client threads per round (default 4)")
    parser.add_argument("--per-stream", type=int, default=4, help="requests per client thread a round (default 4)")
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest completion (default 16)")
    parser.add_argument("--max-tokens", type=int, default=48, help="longest completion (default 48)")
    parser.add_argument("--fraction", type=float, default=1.0,
                        help="--shadow-fraction of the stack (default 1: every request mirrored)")
    parser.add_argument("--chunks", type=int, default=32, help="golden-set chunks of 512 tokens for the gate")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-shadow-") as tmp:
        payload = {"machine": machine(), "command": "python -m bench.shadow " + " ".join(argv or sys.argv[1:]),
                   **bench(args, Path(tmp))}
    json_path, md_path = write_results("shadow", payload, markdown(payload))
    print(markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
