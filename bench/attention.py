"""The paged attention kernel (``cpu_attention.cpp``) per layer, against PyTorch's SDPA.

``python -m bench.attention [--reps N] [--name NAME]`` → ``bench/results/NAME.{json,md}`` (default
``attention``; one file per machine class, e.g. ``attention-amd-avx512``).

One layer's attention at the shapes serving meets, bfloat16, blocks of 16 in shuffled order:
decode steps (one query row per sequence) and prefills (every prompt token a row over its own
prefix, as ``prefill_attention`` runs them), for SmolLM2-135M's heads (9 query / 3 KV, d 64) and
the 1B-class shape's (32 / 8, d 64). Three ways, on the same inputs:

- ``kernel``: the C++ kernel as it runs here (on AMX tiles where the machine has them, else on
  AVX512-BF16 vectors, a prefill's rows together: ``cpu_attention_rows.h``);
- ``vector``: the same kernel with ``SHARDLINE_AMX=0`` (the AVX512-BF16 rows kernel), in a child
  process;
- ``per row``: ``SHARDLINE_AMX=0 SHARDLINE_ATTENTION_ROWS=0``, the float32 kernel taking one row at
  a time (what bfloat16 ran on before the rows kernels, and still runs on without AVX512-BF16);
- ``sdpa``: the reference, blocks gathered then ``scaled_dot_product_attention`` (per sequence,
  causal, for a prefill: PyTorch's flash kernel on CPU).

Figures are medians over ``--reps`` calls, ms per layer, with GFLOP/s counting 4·d flops per
(query head, key) pair (q·k and p·v).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from bench.common import machine, median_time, publish_results
from services.modeling.attention import AttentionMetadata
from services.modeling.kernels import TorchOps, cpu_arch, cpu_kernels, ops_for

BLOCK = 16
SHAPES = {"smollm2-135m": (9, 3, 64), "1b-class": (32, 8, 64)}  # query heads, KV heads, head_dim
# name: (new tokens per sequence, cached tokens before them, sequences)
CASES = {
    "decode 16 x 1k": (1, 1024, 16),
    "decode 1 x 1k": (1, 1024, 1),
    "prefill 128 after 1k cached": (128, 1024, 1),
    "prefill 1k": (1024, 0, 1),
}


def inputs(heads: int, kv_heads: int, d: int, new: int, cached: int, seqs: int):
    gen = torch.Generator().manual_seed(0)
    ctx = cached + new
    per_seq = -(-ctx // BLOCK)
    blocks = per_seq * seqs + 1
    caches = [torch.randn(blocks, BLOCK, kv_heads, d, generator=gen).to(torch.bfloat16) for _ in range(2)]
    order = torch.randperm(blocks, generator=gen)[:per_seq * seqs]
    tables = order.view(seqs, per_seq).to(torch.int64)
    q = torch.randn(new * seqs, heads, d, generator=gen).to(torch.bfloat16)
    meta = AttentionMetadata(query_lens=[new] * seqs, context_lens=[ctx] * seqs, block_tables=tables)
    return q, caches, meta


def flops(heads: int, d: int, new: int, cached: int, seqs: int) -> float:
    pairs = sum(cached + j + 1 for j in range(new)) * seqs  # (row, key) pairs, causally
    return 4.0 * d * heads * pairs


def measure(reps: int, methods: list[str]) -> dict[str, dict[str, float]]:
    """ms per layer: {shape/case: {method: ms}}."""
    ops, ref = ops_for("cpu"), TorchOps()
    out: dict[str, dict[str, float]] = {}
    for shape, (heads, kv_heads, d) in SHAPES.items():
        for case, (new, cached, seqs) in CASES.items():
            q, (k, v), meta = inputs(heads, kv_heads, d, new, cached, seqs)
            attend = {"kernel": ops.decode_attention if new == 1 else ops.prefill_attention,
                      "sdpa": ref.decode_attention if new == 1 else ref.prefill_attention}
            args = (q, k, v, meta, 0.125)
            out[f"{shape} / {case}"] = {m: 1e3 * median_time(lambda f=attend[m], a=args: f(*a), reps=reps)
                                        for m in methods}
    return out


def child(reps: int, env: dict[str, str]) -> dict[str, dict[str, float]]:
    """measure()'s kernel times in a child process with ``env`` added (flags read once at start)."""
    run = subprocess.run([sys.executable, "-m", "bench.attention", "--child", "--reps", str(reps)],
                         env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--name", default="attention", help="results: bench/results/NAME.{json,md}")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the vector run, as JSON
    args = parser.parse_args(argv)
    assert cpu_kernels() is not None, "the CPU kernels did not build"
    if args.child:
        print(json.dumps(measure(args.reps, ["kernel"])))
        return 0
    here = measure(args.reps, ["kernel", "sdpa"])
    vector = child(args.reps, {"SHARDLINE_AMX": "0"})
    per_row = child(args.reps, {"SHARDLINE_AMX": "0", "SHARDLINE_ATTENTION_ROWS": "0"})
    rows = []
    for name, times in here.items():
        shape, case = name.split(" / ")
        heads, _, d = SHAPES[shape]
        gflop = flops(heads, d, *CASES[case]) / 1e9
        row = {"shape": shape, "case": case, "kernel_ms": times["kernel"], "vector_ms": vector[name]["kernel"],
               "per_row_ms": per_row[name]["kernel"], "sdpa_ms": times["sdpa"],
               "kernel_gflops": gflop / times["kernel"] * 1e3}
        row["kernel_vs_vector"] = row["kernel_ms"] / row["vector_ms"]
        row["kernel_vs_per_row"] = row["kernel_ms"] / row["per_row_ms"]
        row["kernel_vs_sdpa"] = row["kernel_ms"] / row["sdpa_ms"]
        rows.append(row)
    info = machine()
    lines = ["# Paged attention per layer (bfloat16, blocks of 16)", "",
             f"`python -m bench.attention --reps {args.reps}`; {info['cpu_model']} ({' '.join(info['cpu_flags'])}), "
             f"{torch.get_num_threads()} threads, kernels built for `-march={cpu_arch()}`, torch's own kernels at "
             f"`{torch.backends.cpu.get_cpu_capability()}`. "
             "`kernel`: as it runs here; `vector`: `SHARDLINE_AMX=0`; `per row`: also "
             "`SHARDLINE_ATTENTION_ROWS=0`; `sdpa`: gather + `scaled_dot_product_attention`. "
             "ms per layer, medians.", "",
             "| shape | case | kernel ms | vector ms | per row ms | SDPA ms | kernel / vector | kernel / per row "
             "| kernel / SDPA | kernel GFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['case']} | {r['kernel_ms']:.3f} | {r['vector_ms']:.3f} | {r['per_row_ms']:.3f} | "
              f"{r['sdpa_ms']:.3f} | {r['kernel_vs_vector']:.2f} | {r['kernel_vs_per_row']:.2f} | "
              f"{r['kernel_vs_sdpa']:.2f} | {r['kernel_gflops']:.0f} |" for r in rows]
    return publish_results(args.name, {"machine": info, "march": cpu_arch(), "reps": args.reps, "rows": rows},
                           "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
