"""The dense bfloat16 matmul (``dense_linear``, ``cpu_gemm.cpp``) against oneDNN through
``F.linear`` on the same operands, from a decode step's rows to a long prefill's.

``python -m bench.gemm [--rows 1,16,128,512,2048] [--shapes smollm2,1b-class] [--passes 7]
[--name gemm]`` → ``bench/results/NAME.{json,md}``.

The linear shapes of SmolLM2-135M and of the 1B-class shape ``bench.serving --model 1b-class``
serves (fused qkv and gate_up as the model runs them). Per shape and row count the two run
alternately, pass after pass, each pass long enough (~0.2 s) to average out a timer's grain;
the figures are medians over the passes, GFLOP/s at 2·M·N·K, and the ratio of our time to
oneDNN's (below 1: ours is faster). Ours is batch-invariant (a row's sums do not depend on M);
oneDNN's is not, so the ratio is the price of that property where it is above 1. Measure with
the machine quiet (``uptime``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.common import machine, publish_results
from services.modeling.kernels import cpu_arch, cpu_kernels

SHAPES = {  # name: {linear: (N, K)}
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "1b-class": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}


def timed_pair(ours, theirs, flops: float, passes: int) -> tuple[float, float]:
    """Median seconds per call of each, alternating passes of about 0.2 s."""
    for fn in (ours, theirs):
        fn()
    start = time.perf_counter()
    theirs()
    reps = max(1, int(0.2 / max(time.perf_counter() - start, 1e-6)))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(passes):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t0) / reps)
    return statistics.median(times[0]), statistics.median(times[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,128,512,2048")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--name", default="gemm", help="results: bench/results/NAME.{json,md}")
    args = parser.parse_args(argv)
    kernels = cpu_kernels()
    if kernels is None or not kernels.dense_linear_vectorized():
        print("dense_linear is torch's own linear here (no vectorised build): nothing to compare", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        for name, (n, k) in SHAPES[shape].items():
            w = (0.05 * torch.randn(n, k)).bfloat16()
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k).bfloat16()
                ours, theirs = timed_pair(lambda x=x, w=w: kernels.dense_linear(x, w),
                                          lambda x=x, w=w: F.linear(x, w), 2.0 * m * n * k, args.passes)
                row = {"shape": shape, "linear": name, "n": n, "k": k, "rows": m,
                       "ours_gflops": 2e-9 * m * n * k / ours, "onednn_gflops": 2e-9 * m * n * k / theirs,
                       "ours_vs_onednn": ours / theirs}
                rows.append(row)
                print(f"{shape} {name} {m} rows: ours {row['ours_gflops']:.0f}, oneDNN {row['onednn_gflops']:.0f} "
                      f"GFLOP/s ({row['ours_vs_onednn']:.2f})", flush=True)
    info = machine()
    lines = ["# Dense bfloat16 matmul: `dense_linear` against oneDNN (`F.linear`)", "",
             f"`python -m bench.gemm {' '.join(argv if argv is not None else sys.argv[1:])}`; {info['cpu_model']} "
             f"({' '.join(info['cpu_flags'])}), {torch.get_num_threads()} threads, kernels built for "
             f"`-march={cpu_arch()}`, medians of {args.passes} alternating passes. Ratio: our time / oneDNN's.", "",
             "| shape | linear (N x K) | rows | ours GFLOP/s | oneDNN GFLOP/s | ours / oneDNN |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['linear']} ({r['n']} x {r['k']}) | {r['rows']} | {r['ours_gflops']:.0f} | "
              f"{r['onednn_gflops']:.0f} | {r['ours_vs_onednn']:.2f} |" for r in rows]
    return publish_results(args.name, {"machine": info, "march": cpu_arch(), "passes": args.passes, "rows": rows},
                           "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
