"""Engine benchmark: our engine vs HF transformers on the same weights, the bare-matmul floor and
the memory roofline, plus TP/PP step times with the share spent in collectives.

    python -m bench.engine [--quick] [--dtypes bfloat16,float32]   (also: shardline bench engine)

Writes bench/results/engine.json (top-level ratios for bfloat16: tpot_vs_hf_bs1,
throughput_vs_hf_sequential, throughput_vs_hf_batched, step_vs_floor) and engine.md.
Everything is measured in one run on one machine, same dtype, same prompts.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.common import machine, median_time, smollm2_dir, write_results
from services.worker.engine.engine import FinishEvent, TokenEvent
from services.worker.engine.group import EngineSpec, build_engine, start_rank
from services.worker.engine.kv_cache import CacheConfig
from services.worker.engine.runner import follower_loop
from services.worker.engine.sequence import SamplingParams
from services.worker.parallel.launch import run_replica_group
from services.worker.runtime import RankSpec

TEXT = ("The river runs through the middle of the old town, and on summer evenings people walk along its banks "
        "to watch the boats come in. Most of the houses near the water were built more than two hundred years "
        "ago, when the town was a busy port.")


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT).ids
    return [ids[: 8 + (i * 5) % 32] for i in range(n)]


def spec_for(model_dir, dtype: str, tp: int = 1, pp: int = 1) -> EngineSpec:
    return EngineSpec(RankSpec(str(model_dir), tp, pp, dtype), CacheConfig(kv_cache_bytes=512 << 20))


def run_engine(engine, prompts, max_tokens: int) -> dict:
    """Submit every prompt at once, run to completion; per-request TPOT and the step times."""
    engine.step_times_s.clear()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]
    engine.run_until_done()
    elapsed = time.perf_counter() - t0
    tpots = []
    for handle in handles:
        events = []
        while not handle.events.empty():
            events.append(handle.events.get())
        fin = next(e for e in events if isinstance(e, FinishEvent))
        n = sum(isinstance(e, TokenEvent) for e in events)
        tpots.append((fin.total_ns - fin.first_token_ns) / 1e9 / max(1, n - 1))
    steps = list(engine.step_times_s)
    full = [t for t in steps[len(steps) // 4:]]  # decode steps with the whole batch (skip prefill/ramp)
    return {"elapsed_s": elapsed, "tokens": len(prompts) * max_tokens, "tok_per_s": len(prompts) * max_tokens / elapsed,
            "tpot_s": statistics.median(tpots), "decode_step_s": statistics.median(full) if full else float("nan")}


def hf_measure(model_dir, dtype: str, prompts, max_tokens: int, *, sequential_n: int) -> dict:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()

    def gen(batch: list[list[int]], n: int) -> None:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)

    one = prompts[0]
    t_full = median_time(lambda: gen([one], max_tokens), reps=3)
    t_first = median_time(lambda: gen([one], 1), reps=3)
    tpot = (t_full - t_first) / (max_tokens - 1)
    t0 = time.perf_counter()
    for p in prompts[:sequential_n]:
        gen([p], max_tokens)
    seq_tok_s = sequential_n * max_tokens / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    gen(prompts, max_tokens)
    batched_tok_s = len(prompts) * max_tokens / (time.perf_counter() - t0)
    return {"tpot_s": tpot, "sequential_tok_per_s": seq_tok_s, "batched_tok_per_s": batched_tok_s}


def matmul_floor(model, batch: int, dtype: torch.dtype, reps: int, context: int = 0) -> float:
    """A bare loop over the decode step's matmuls (the kernel floor) at ``batch`` rows: the four
    weight matmuls of every layer, the attention matmuls (q·kᵀ and p·v over ``context`` cached
    tokens per row, grouped-query shapes, already contiguous: no gather, no softmax) and lm_head."""
    layers = list(model.model.layers.values())
    hidden = model.config.hidden_size
    x = torch.randn(batch, hidden, dtype=dtype)
    mid = torch.randn(batch, layers[0].mlp.down_proj.in_local, dtype=dtype)
    attn = torch.randn(batch, layers[0].self_attn.o_proj.in_local, dtype=dtype)
    lm_head = model.lm_head.weight
    a = layers[0].self_attn
    kv, group, d = a.kv_heads, a.heads // a.kv_heads, a.head_dim
    q = torch.randn(batch, kv, group, d, dtype=dtype)
    keys_t = torch.randn(batch, kv, d, max(context, 1), dtype=dtype)
    probs = torch.randn(batch, kv, group, max(context, 1), dtype=dtype)
    values = torch.randn(batch, kv, max(context, 1), d, dtype=dtype)

    def loop() -> None:
        for layer in layers:
            F.linear(x, layer.self_attn.qkv_proj.weight)
            if context:
                torch.matmul(q, keys_t)
                torch.matmul(probs, values)
            F.linear(attn, layer.self_attn.o_proj.weight)
            F.linear(x, layer.mlp.gate_up_proj.weight)
            F.linear(mid, layer.mlp.down_proj.weight)
        F.linear(x, lm_head)

    with torch.inference_mode():
        return median_time(loop, reps=reps, warmup=2)


def read_bandwidth(dtype: torch.dtype) -> float:
    big = torch.ones(256 << 20, dtype=dtype)  # 512 MB in 16-bit, 1 GB in fp32
    seconds = median_time(lambda: big.sum(), reps=5)
    return big.numel() * big.element_size() / seconds


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.dim() == 2 and id(p) not in seen and "embed_tokens" not in name:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    if model.lm_head is not None and id(model.lm_head.weight) not in seen:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def layout_rank(rank: int, world: int, spec: EngineSpec, prompts, max_tokens: int) -> dict | None:
    runner, layout = start_rank(spec, rank)
    if rank != 0:
        follower_loop(runner)
        return None
    engine = build_engine(spec, runner, layout)
    run_engine(engine, prompts, 4)  # warm-up
    sink = runner.rt.coordinator.sink
    sink.drain()
    result = run_engine(engine, prompts, max_tokens)
    engine.shutdown()
    events = sink.drain()
    per_op = collections.defaultdict(float)
    for e in events:
        per_op[e.op_type] += e.duration_ms / 1e3
    comm = sum(v for k, v in per_op.items() if k in ("all_reduce", "all_gather", "send", "recv"))
    result["collective_share"] = comm / result["elapsed_s"]
    result["per_op_s"] = dict(per_op)
    return result


def median_run(engine, prompts, max_tokens: int, runs: int) -> dict:
    """Per-key median over ``runs`` runs: one disturbed run does not decide the figure."""
    results = [run_engine(engine, prompts, max_tokens) for _ in range(runs)]
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def bench_dtype(model_dir, tokenizer, dtype: str, *, quick: bool, compile: bool = True) -> dict:
    n_req, max_tokens = (4, 16) if quick else (16, 64)
    runs = 1 if quick else 3
    prompts = make_prompts(tokenizer, n_req)
    spec = spec_for(model_dir, dtype)
    runner, layout = start_rank(spec, 0)
    engine = build_engine(spec, runner, layout)
    run_engine(engine, prompts[:2], 4)  # warm-up
    eager_bs1 = median_run(engine, prompts[:1], max_tokens, runs)
    eager_batch = median_run(engine, prompts, max_tokens, runs)
    ours_bs1, ours_batch = eager_bs1, eager_batch
    compile_s = None
    if compile:  # what `--compile` does at start-up, timed
        t0 = time.perf_counter()
        runner.rt.model.compile_segments(warm_up=True)
        compile_s = time.perf_counter() - t0
        run_engine(engine, prompts[:2], 4)
        ours_bs1 = median_run(engine, prompts[:1], max_tokens, runs)
        ours_batch = median_run(engine, prompts, max_tokens, runs)
    tdtype = runner.rt.plan.torch_dtype
    reps = 5 if quick else 20
    # mean context over the measured decode steps: prompt + half the completion
    ctx1 = round(len(prompts[0]) + max_tokens / 2)
    ctx_b = round(statistics.mean(map(len, prompts)) + max_tokens / 2)
    floor1 = matmul_floor(runner.rt.model, 1, tdtype, reps, ctx1)
    floor_b = matmul_floor(runner.rt.model, n_req, tdtype, reps, ctx_b)
    bw = read_bandwidth(tdtype)
    wbytes = weight_bytes(runner.rt.model)
    hf = hf_measure(model_dir, dtype, prompts, max_tokens, sequential_n=2 if quick else n_req)
    out = {
        "requests": n_req, "new_tokens": max_tokens,
        "ours": {"tpot_bs1_s": ours_bs1["tpot_s"], "decode_step_bs1_s": ours_bs1["decode_step_s"],
                 "decode_step_batch_s": ours_batch["decode_step_s"], "batch_tok_per_s": ours_batch["tok_per_s"],
                 "compiled": compile, "compile_s": compile_s},
        "eager": {"tpot_bs1_s": eager_bs1["tpot_s"], "decode_step_bs1_s": eager_bs1["decode_step_s"],
                  "decode_step_batch_s": eager_batch["decode_step_s"], "batch_tok_per_s": eager_batch["tok_per_s"]},
        "hf": hf,
        "floor": {"matmul_bs1_s": floor1, "matmul_batch_s": floor_b, "weight_bytes": wbytes,
                  "read_bandwidth_bytes_per_s": bw, "roofline_s": wbytes / bw},
    }
    out["tpot_vs_hf_bs1"] = ours_bs1["tpot_s"] / hf["tpot_s"]
    out["throughput_vs_hf_sequential"] = ours_batch["tok_per_s"] / hf["sequential_tok_per_s"]
    out["throughput_vs_hf_batched"] = ours_batch["tok_per_s"] / hf["batched_tok_per_s"]
    out["step_vs_floor_bs1"] = ours_bs1["decode_step_s"] / floor1
    out[f"step_vs_floor_bs{n_req}"] = ours_batch["decode_step_s"] / floor_b
    out["step_vs_floor"] = max(out["step_vs_floor_bs1"], out[f"step_vs_floor_bs{n_req}"])
    out["step_vs_roofline_bs1"] = ours_bs1["decode_step_s"] / (wbytes / bw)
    out["eager_step_vs_floor_bs1"] = eager_bs1["decode_step_s"] / floor1
    out[f"eager_step_vs_floor_bs{n_req}"] = eager_batch["decode_step_s"] / floor_b
    return out


def bench_layouts(model_dir, tokenizer, dtype: str) -> dict:
    prompts = make_prompts(tokenizer, 1)
    results = {}
    for tp, pp in [(1, 1), (3, 1), (1, 2)]:
        spec = spec_for(model_dir, dtype, tp, pp)
        r = run_replica_group(tp * pp, layout_rank, spec, prompts, 32)
        results[f"tp{tp}_pp{pp}"] = {"tpot_s": r["tpot_s"], "collective_share": r["collective_share"],
                                     "per_op_s": r["per_op_s"]}
    return results


def markdown(payload: dict) -> str:
    lines = ["# Engine benchmark (SmolLM2-135M, CPU)", "",
             f"Machine: {payload['machine']['processor']}, {payload['machine']['cpu_count']} cores, "
             f"torch {payload['machine']['torch']}. Command: `python -m bench.engine"
             f"{' --quick' if payload['quick'] else ''}`.", "",
             "| dtype | ours TPOT bs1 | HF TPOT bs1 | tpot_vs_hf_bs1 | ours tok/s (batch) | HF seq tok/s | "
             "HF batched tok/s | vs seq | vs batched | step/floor bs1 | step/floor batch | step/roofline bs1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for dtype, r in payload["dtypes"].items():
        n = r["requests"]
        lines.append(
            f"| {dtype} | {r['ours']['tpot_bs1_s'] * 1e3:.1f} ms | {r['hf']['tpot_s'] * 1e3:.1f} ms | "
            f"{r['tpot_vs_hf_bs1']:.2f} | {r['ours']['batch_tok_per_s']:.1f} | {r['hf']['sequential_tok_per_s']:.1f} | "
            f"{r['hf']['batched_tok_per_s']:.1f} | {r['throughput_vs_hf_sequential']:.2f} | "
            f"{r['throughput_vs_hf_batched']:.2f} | {r['step_vs_floor_bs1']:.2f} | {r[f'step_vs_floor_bs{n}']:.2f} | "
            f"{r['step_vs_roofline_bs1']:.2f} |")
    lines += ["", "\"ours\" is the engine as `--compile` runs it (the decoder layers' dense segments compiled by "
              "inductor at bucketed batch sizes, models/fused.py); the eager engine, same run:", "",
              "| dtype | compile at start-up | eager step bs1 | compiled step bs1 | eager step batch | "
              "compiled step batch | eager step/floor bs1 | eager step/floor batch |", "|---|---|---|---|---|---|---|---|"]
    for dtype, r in payload["dtypes"].items():
        n, e, o = r["requests"], r["eager"], r["ours"]
        compiled = o.get("compiled")
        lines.append(
            f"| {dtype} | {o['compile_s']:.0f} s | " if compiled else f"| {dtype} | (not compiled) | ")
        lines[-1] += (f"{e['decode_step_bs1_s'] * 1e3:.1f} ms | {o['decode_step_bs1_s'] * 1e3:.1f} ms | "
                      f"{e['decode_step_batch_s'] * 1e3:.1f} ms | {o['decode_step_batch_s'] * 1e3:.1f} ms | "
                      f"{r['eager_step_vs_floor_bs1']:.2f} | {r[f'eager_step_vs_floor_bs{n}']:.2f} |")
    lines += ["", "Floor: a bare loop of the decode step's matmuls at the same batch (every layer's four weight "
              "matmuls, the attention q·kᵀ and p·v over the mean context, lm_head), nothing else. Roofline: "
              "weight bytes / measured read bandwidth. HF: `transformers` generate() on the same weights and "
              "dtype, batch 1, one request at a time, and all requests padded into one batch."]
    if payload.get("layouts"):
        lines += ["", "| layout | TPOT bs1 | time in collectives (rank 0) |", "|---|---|---|"]
        for name, r in payload["layouts"].items():
            lines.append(f"| {name} | {r['tpot_s'] * 1e3:.1f} ms | {r['collective_share'] * 100:.0f} % |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardline bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run (under a minute)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M from the wheel)")
    parser.add_argument("--no-layouts", action="store_true", help="skip the TP/PP comparison")
    parser.add_argument("--no-compile", action="store_true",
                        help="measure the eager engine only (default: eager, then --compile)")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    model_dir = args.model or smollm2_dir()
    tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    dtypes = ["bfloat16"] if args.quick else args.dtypes.split(",")
    payload = {"machine": machine(), "quick": args.quick, "model": str(model_dir), "dtypes": {}}
    for dtype in dtypes:
        payload["dtypes"][dtype] = bench_dtype(model_dir, tokenizer, dtype, quick=args.quick,
                                               compile=not args.no_compile)
        print(dtype, {k: round(v, 3) for k, v in payload["dtypes"][dtype].items() if isinstance(v, float)}, flush=True)
    main_dtype = payload["dtypes"].get("bfloat16") or next(iter(payload["dtypes"].values()))
    for key in ("tpot_vs_hf_bs1", "throughput_vs_hf_sequential", "throughput_vs_hf_batched", "step_vs_floor"):
        payload[key] = main_dtype[key]
    if not args.quick and not args.no_layouts:
        payload["layouts"] = bench_layouts(model_dir, tokenizer, "bfloat16")
    name = "engine-quick" if args.quick else "engine"
    json_path, md_path = write_results(name, payload, markdown(payload))
    print(markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
