"""Engine benchmark: our engine vs HF transformers on the same weights, the bare-matmul floor and
the memory roofline, plus TP/PP step times with the share spent in collectives.

    python -m bench.engine [--quick] [--dtypes bfloat16,float32] [--name NAME]   (also: shardline bench engine)

Writes bench/results/engine.json (top-level ratios for bfloat16: tpot_vs_hf_bs1,
throughput_vs_hf_sequential, throughput_vs_hf_batched, step_vs_floor) and engine.md.
Everything is measured in one run on one machine, same dtype, same prompts. step/roofline bs1:
each batch-1 decode step followed by a streaming read (torch's sum) of as many bytes as the step's
weights, the median of the pairs' ratios.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch
from tokenizers import Tokenizer

from bench.common import machine, median_time, smollm2_dir, write_results
from services.common.sampling import SamplingParams
from services.modeling.kernels import TorchOps, dense_linear
from services.worker.engine.bootstrap import build_engine, start_rank
from services.worker.engine.engine import FinishEvent
from services.worker.engine.kv_cache import CacheConfig
from services.worker.engine.runner import follower_loop
from services.worker.engine.step import TokenEvent
from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec

TEXT = ("The river runs through the middle of the old town, and on summer evenings people walk along its banks "
        "to watch the boats come in. Most of the houses near the water were built more than two hundred years "
        "ago, when the town was a busy port.")


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT).ids
    return [ids[: 8 + (i * 5) % 32] for i in range(n)]


def spec_for(model_dir, dtype: str, tp: int = 1, pp: int = 1) -> RankSpec:
    return RankSpec(str(model_dir), tp_degree=tp, pp_degree=pp, dtype=dtype,
                    cache=CacheConfig(kv_cache_bytes=512 << 20))


def run_engine(engine, prompts, max_tokens: int, *, guide: tuple[str, str] | None = None) -> dict:
    """Submit every prompt at once (greedy, ignore_eos, ``guide`` if given), run to completion;
    per-request TPOT and the step times."""
    engine.step_times_s.clear()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, guide=guide)
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


class HFReference:
    """HF transformers' generate() on the same weights and dtype (the peer)."""

    def __init__(self, model_dir, dtype: str) -> None:
        # deferred: the HF peer is a test dependency, not a runtime one
        import transformers

        self.model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()

    def generate_s(self, batch: list[list[int]], n: int) -> float:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=0)
        return time.perf_counter() - t0

    def tpot_s(self, prompt: list[int], max_tokens: int) -> float:
        """(time for max_tokens − time for 1) / (max_tokens − 1): decode only, prefill cancels out."""
        return (self.generate_s([prompt], max_tokens) - self.generate_s([prompt], 1)) / (max_tokens - 1)

    def sequential_tok_s(self, prompts, max_tokens: int) -> float:
        return len(prompts) * max_tokens / sum(self.generate_s([p], max_tokens) for p in prompts)

    def batched_tok_s(self, prompts, max_tokens: int) -> float:
        return len(prompts) * max_tokens / self.generate_s(prompts, max_tokens)


def floor_loop(model, batch: int, dtype: torch.dtype, context: int):
    """A bare loop over the decode step's matmuls (the kernel floor) at ``batch`` rows: the four
    weight matmuls of every layer (``dense_linear`` on each weight as its layer holds it, packed
    or not), the attention matmuls (q·kᵀ and p·v over ``context`` cached
    tokens per row, grouped-query shapes, already contiguous: no gather, no softmax) and lm_head."""
    layers = list(model.model.layers.values())
    hidden = model.config.hidden_size
    x = torch.randn(batch, hidden, dtype=dtype)
    mid = torch.randn(batch, layers[0].mlp.down_proj.in_local, dtype=dtype)
    attn = torch.randn(batch, layers[0].self_attn.o_proj.in_local, dtype=dtype)
    lm_head = model.lm_head
    a = layers[0].self_attn
    kv, group, d = a.kv_heads, a.heads // a.kv_heads, a.head_dim
    q = torch.randn(batch, kv, group, d, dtype=dtype)
    keys_t = torch.randn(batch, kv, d, context, dtype=dtype)
    probs = torch.randn(batch, kv, group, context, dtype=dtype)
    values = torch.randn(batch, kv, context, d, dtype=dtype)

    @torch.inference_mode()
    def loop() -> None:
        for layer in layers:
            dense_linear(x, layer.self_attn.qkv_proj.kernel_weight())
            torch.matmul(q, keys_t)
            torch.matmul(probs, values)
            dense_linear(attn, layer.self_attn.o_proj.kernel_weight())
            dense_linear(x, layer.mlp.gate_up_proj.kernel_weight())
            dense_linear(mid, layer.mlp.down_proj.kernel_weight())
        dense_linear(x, lm_head.kernel_weight())

    return loop


def paired_steps(engine, prompts, steps: int, other=None) -> dict:
    """Decode steps of a full batch, each followed by one floor loop at the same batch and mean
    context (or by ``other``): the step/floor ratio is taken pair by pair, so a machine whose
    speed drifts (shared cores, a memory bus shared with other machines) moves both sides of each
    ratio alike."""
    model = engine.runner.rt.model
    context = round(statistics.mean(map(len, prompts)) + 4 + steps / 2)
    loop = other or floor_loop(model, len(prompts), engine.runner.rt.plan.torch_dtype, context)
    params = SamplingParams(temperature=0, max_tokens=steps + 6, ignore_eos=True)
    for p in prompts:
        engine.submit(p, params)
    for _ in range(4):  # prefill and first decodes
        engine.step()
    loop()
    pairs = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        loop()
        pairs.append((t1 - t0, time.perf_counter() - t1))
    engine.run_until_done()
    return {"step_s": statistics.median(p[0] for p in pairs), "floor_s": statistics.median(p[1] for p in pairs),
            "ratio": statistics.median(p[0] / p[1] for p in pairs), "context": context}


def weight_read(nbytes: int, dtype: torch.dtype):
    """A streaming read of ``nbytes`` (torch's own ``sum`` over a tensor of that size, far larger
    than the caches): the memory roofline of a step that reads that many bytes of weights."""
    big = torch.ones(nbytes // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
    return lambda: big.sum()


def read_bandwidth(dtype: torch.dtype, nbytes: int = 512 << 20) -> float:
    """Bytes per second of :func:`weight_read` over ``nbytes`` (the median of five)."""
    return nbytes / median_time(weight_read(nbytes, dtype), reps=5)


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.dim() >= 2 and id(p) not in seen and "embed_tokens" not in name:  # a packed weight is 4-D
            seen.add(id(p))
            total += p.numel() * p.element_size()
    if model.lm_head is not None and id(model.lm_head.weight) not in seen:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def layout_rank(rank: int, world: int, spec: RankSpec, prompts, max_tokens: int) -> dict | None:
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


def bench_dtype(model_dir, tokenizer, dtype: str, *, quick: bool) -> dict:
    """Ours and HF alternate round by round; each figure is the median of its per-round ratios."""
    n_req, max_tokens = (4, 16) if quick else (16, 64)
    rounds, steps, seq_n = (1, 8, 2) if quick else (3, 24, 4)
    prompts = make_prompts(tokenizer, n_req)
    spec = spec_for(model_dir, dtype)
    runner, layout = start_rank(spec, 0)
    engine = build_engine(spec, runner, layout)
    hf = HFReference(model_dir, dtype)
    run_engine(engine, prompts[:2], 4)  # warm-up
    hf.generate_s(prompts[:2], 2)
    per_round = []
    for _ in range(rounds):
        ours_bs1 = run_engine(engine, prompts[:1], max_tokens)
        hf_tpot = hf.tpot_s(prompts[0], max_tokens)
        ours_batch = run_engine(engine, prompts, max_tokens)
        hf_batched = hf.batched_tok_s(prompts, max_tokens)
        hf_seq = hf.sequential_tok_s(prompts[:seq_n], max_tokens)
        per_round.append({"ours_tpot_s": ours_bs1["tpot_s"], "hf_tpot_s": hf_tpot,
                          "ours_tok_s": ours_batch["tok_per_s"], "hf_batched_tok_s": hf_batched,
                          "hf_sequential_tok_s": hf_seq})
    med = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    ratio = lambda num, den: statistics.median(r[num] / r[den] for r in per_round)  # noqa: E731

    layers = runner.rt.model.model
    kernels = layers.ops
    floor = {}
    for name, ops in (("kernels", kernels), ("torch_ops", TorchOps())):
        layers.ops = ops  # the same engine with the element-wise work as plain PyTorch ops
        floor[name] = {"bs1": paired_steps(engine, prompts[:1], steps),
                       f"bs{n_req}": paired_steps(engine, prompts, steps)}
    layers.ops = kernels
    tdtype = runner.rt.plan.torch_dtype
    wbytes = weight_bytes(runner.rt.model)
    # each batch-1 step against a streaming read of the step's weight bytes right after it
    roofline = paired_steps(engine, prompts[:1], steps, weight_read(wbytes, tdtype))
    bw = wbytes / roofline["floor_s"]
    ours = floor["kernels"]
    out = {
        "requests": n_req, "new_tokens": max_tokens, "rounds": rounds, "per_round": per_round, "medians": med,
        "layer_ops": type(kernels).__name__, "floor_pairs": floor,
        "roofline": {"weight_bytes": wbytes, "read_bandwidth_bytes_per_s": bw, "roofline_s": roofline["floor_s"],
                     "step_s": roofline["step_s"]},
        "tpot_vs_hf_bs1": ratio("ours_tpot_s", "hf_tpot_s"),
        "throughput_vs_hf_sequential": ratio("ours_tok_s", "hf_sequential_tok_s"),
        "throughput_vs_hf_batched": ratio("ours_tok_s", "hf_batched_tok_s"),
        "step_vs_floor_bs1": ours["bs1"]["ratio"],
        f"step_vs_floor_bs{n_req}": ours[f"bs{n_req}"]["ratio"],
        "step_vs_roofline_bs1": roofline["ratio"],
    }
    out["step_vs_floor"] = max(out["step_vs_floor_bs1"], out[f"step_vs_floor_bs{n_req}"])
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
        n, m = r["requests"], r["medians"]
        lines.append(
            f"| {dtype} | {m['ours_tpot_s'] * 1e3:.1f} ms | {m['hf_tpot_s'] * 1e3:.1f} ms | "
            f"{r['tpot_vs_hf_bs1']:.2f} | {m['ours_tok_s']:.1f} | {m['hf_sequential_tok_s']:.1f} | "
            f"{m['hf_batched_tok_s']:.1f} | {r['throughput_vs_hf_sequential']:.2f} | "
            f"{r['throughput_vs_hf_batched']:.2f} | {r['step_vs_floor_bs1']:.2f} | {r[f'step_vs_floor_bs{n}']:.2f} | "
            f"{r['step_vs_roofline_bs1']:.2f} |")
    first = next(iter(payload["dtypes"].values()))
    n = first["requests"]
    lines += ["", f"Ratios are medians of per-round ratios ({first['rounds']} rounds; ours and HF alternate within "
              f"each round), so a drift in machine speed moves both sides of a ratio alike. Batch: {n} requests "
              f"x {first['new_tokens']} new tokens submitted together; HF sequential: one request at a time; HF "
              "batched: all padded into one generate() call.", ""]
    for dtype, r in payload["dtypes"].items():
        roof = r["roofline"]
        lines += [f"Roofline, {dtype}: each batch-1 step ({roof['step_s'] * 1e3:.2f} ms, median) followed by a "
                  f"streaming read of its {roof['weight_bytes'] / 1e6:.0f} MB of weights "
                  f"({roof['roofline_s'] * 1e3:.2f} ms, {roof['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s): "
                  "step/roofline "
                  f"{r['step_vs_roofline_bs1']:.2f}, the median of the pairs' ratios.", ""]
    lines += ["Decode step vs floor, pair by pair (each engine step followed by one floor loop at the same batch "
              "and mean context). The floor is a bare loop of the decode step's matmuls: every layer's four "
              "weight matmuls, the attention q·kᵀ and p·v, lm_head. \"kernels\" is the engine as it serves (the "
              "layers' element-wise work and decode attention in C++ kernels, services/modeling/kernels); "
              "\"torch ops\" is the same engine with the layers' work as plain PyTorch ops (attention: gather "
              "the blocks + SDPA; the sampler's kernel stays):", "",
              "| dtype | layer ops | batch | step | floor | step/floor (median of pairs) |",
              "|---|---|---|---|---|---|"]
    for dtype, r in payload["dtypes"].items():
        for ops_name, by_batch in r["floor_pairs"].items():
            for batch, f in by_batch.items():
                lines.append(f"| {dtype} | {ops_name} | {batch} | {f['step_s'] * 1e3:.1f} ms | "
                             f"{f['floor_s'] * 1e3:.1f} ms | {f['ratio']:.2f} |")
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
    parser.add_argument("--name", default=None,
                        help="results: bench/results/NAME.{json,md} (default engine, or engine-quick with "
                             "--quick; name another machine's run apart)")
    args = parser.parse_args(argv)

    model_dir = args.model or smollm2_dir()
    tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    dtypes = ["bfloat16"] if args.quick else args.dtypes.split(",")
    payload = {"machine": machine(), "quick": args.quick, "model": str(model_dir), "dtypes": {}}
    for dtype in dtypes:
        payload["dtypes"][dtype] = bench_dtype(model_dir, tokenizer, dtype, quick=args.quick)
        print(dtype, {k: round(v, 3) for k, v in payload["dtypes"][dtype].items() if isinstance(v, float)}, flush=True)
    main_dtype = payload["dtypes"].get("bfloat16") or next(iter(payload["dtypes"].values()))
    for key in ("tpot_vs_hf_bs1", "throughput_vs_hf_sequential", "throughput_vs_hf_batched", "step_vs_floor"):
        payload[key] = main_dtype[key]
    if not args.quick and not args.no_layouts:
        payload["layouts"] = bench_layouts(model_dir, tokenizer, "bfloat16")
    name = args.name or ("engine-quick" if args.quick else "engine")
    json_path, md_path = write_results(name, payload, markdown(payload))
    print(markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
