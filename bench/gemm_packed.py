"""A candidate bfloat16 GEMM (``bench/prototypes/packed_gemm.cpp``: the weight repacked once into
16-channel blocks of k-pairs, broadcast activation pairs, one vdpbf16ps chain per output, 4 × 64
tiles, K in panels) against oneDNN through ``F.linear`` and our ``dense_linear``, at prefill rows.

``python -m bench.gemm_packed [--rows 128,512,2048] [--passes 5] [--name gemm-packed]`` →
``bench/results/NAME.{json,md}``. Needs AVX512-BF16 (the prototype has no other path); not used by
the model. Per shape and row count the three run in turn, pass after pass; the figure is each
one's median GFLOP/s (2·M·N·K), the prototype's at its best K panel and row block of a small grid,
and its largest error against the float32 product. What it tells: whether the layout the
model's kernel would move to (and the decode kernel with it, to keep a token's bits the same in
any batch) reaches oneDNN's rate where ``dense_linear`` does not.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import machine, publish_results
from bench.gemm import SHAPES
from services.modeling.kernels import cpu_kernels

SOURCE = Path(__file__).with_name("prototypes") / "packed_gemm.cpp"
PANELS = (256, 512, 1024)
ROW_BLOCKS = (64, 512)


def build():
    from torch.utils.cpp_extension import load  # deferred: the C++ toolchain only when measuring

    tag = hashlib.sha1(str(SOURCE.resolve()).encode()).hexdigest()[:10]
    return load(name=f"shardline_packed_gemm_{tag}", sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def seconds(fn, passes: int) -> float:
    """Median seconds per call over ``passes`` passes of about 0.2 s each."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        fn()
        calls += 1
    per_pass = max(1, int(calls * 4))
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        for _ in range(per_pass):
            fn()
        times.append((time.perf_counter() - t) / per_pass)
    return statistics.median(times)


def measure(proto, kernels, n: int, k: int, rows: int, passes: int) -> dict:
    gen = torch.Generator().manual_seed(rows + n + k)
    w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    packed = proto.pack(w)
    flops = 2 * rows * n * k
    onednn = flops / seconds(lambda: F.linear(x, w), passes) / 1e9
    ours = flops / seconds(lambda: kernels.dense_linear(x, w), passes) / 1e9
    grid = {(p, r): flops / seconds(lambda p=p, r=r: proto.matmul(x, packed, p, r), passes) / 1e9
            for p in PANELS for r in ROW_BLOCKS}
    (panel, row_block), best = max(grid.items(), key=lambda item: item[1])
    ref = F.linear(x.float(), w.float())
    err = ((proto.matmul(x, packed, panel, row_block) - ref).abs().max() / ref.abs().max()).item()
    return {"n": n, "k": k, "rows": rows, "onednn_gflops": onednn, "dense_linear_gflops": ours,
            "packed_gflops": best, "packed_panel": panel, "packed_row_block": row_block, "packed_max_rel_err": err,
            "packed_vs_onednn": best / onednn, "packed_vs_dense_linear": best / ours}


def markdown(payload: dict) -> str:
    lines = [f"# A packed bfloat16 GEMM prototype vs oneDNN and `dense_linear` (`{payload['name']}`)", "",
             f"Machine: {payload['machine']}. Command: `{payload['command']}`. GFLOP/s, medians of "
             f"{payload['passes']} passes; the prototype at its best K panel / row block of "
             f"{list(PANELS)} × {list(ROW_BLOCKS)}.", "",
             "| shape | rows | oneDNN | `dense_linear` | prototype (panel, row block) | prototype / oneDNN "
             "| prototype / `dense_linear` | max rel. error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        lines.append(f"| {r['shape']} ({r['n']}×{r['k']}) | {r['rows']} | {r['onednn_gflops']:.0f} | "
                     f"{r['dense_linear_gflops']:.0f} | {r['packed_gflops']:.0f} ({r['packed_panel']}, "
                     f"{r['packed_row_block']}) | {r['packed_vs_onednn']:.2f} | {r['packed_vs_dense_linear']:.2f} | "
                     f"{r['packed_max_rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gemm_packed", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="128,512,2048")
    parser.add_argument("--shapes", default="1b-class,smollm2")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--name", default="gemm-packed")
    args = parser.parse_args(argv)
    kernels = cpu_kernels()
    if kernels is None or not kernels.dense_linear_vectorized():
        print("needs the C++ kernels with the AVX-512 bfloat16 path", file=sys.stderr)
        return 2
    proto = build()
    results = []
    for model in args.shapes.split(","):
        for shape, (n, k) in SHAPES[model].items():
            for rows in map(int, args.rows.split(",")):
                r = {"shape": f"{model} {shape}", **measure(proto, kernels, n, k, rows, args.passes)}
                print(r, flush=True)
                results.append(r)
    payload = {"name": args.name, "machine": machine(), "command": "python -m bench.gemm_packed "
               + " ".join(argv if argv is not None else sys.argv[1:]), "passes": args.passes, "results": results}
    return publish_results(args.name, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
