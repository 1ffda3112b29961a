"""The dense bfloat16 kernel on its two weight layouts against oneDNN: ``dense_linear`` on the
packed weight (``pack_dense``: 16-channel blocks of k-pairs, ``cpu_gemm_packed.cpp``; what a
machine with AVX512-BF16 and no AMX serves), on the ``[N, K]`` rows (``cpu_gemm.cpp``; what it
served before, and what AMX and AVX2 machines serve) and oneDNN's ``F.linear`` on the same operands.

``python -m bench.gemm_packed [--rows 1,4,16,64,256,1024] [--shapes 1b-class,smollm2]
[--passes 7] [--name gemm-packed]`` → ``bench/results/NAME.{json,md}``.

Per shape and row count the three run in turn, pass after pass (each pass ~20 ms of calls); the
figure is each one's median GFLOP/s (2·M·N·K) and the packed kernel's largest error against the
float32 product. The shapes are ``bench.gemm``'s plus each model's lm_head. A weight used call
after call stays in cache when it is small, which a decode step's weights never do: so also, per
model, its whole sequence of weights (every layer's four, then the lm_head: 0.27 / 2.2 GB) at 1
and 16 rows, the two layouts alternating, the figure the median milliseconds of a pass and the
bytes read per second. Needs a machine where ``pack_dense`` packs (``SHARDLINE_CPU_ARCH=x86-64-v3``
measures the AVX2 build); measure with the machine quiet (``uptime``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.common import machine, publish_results
from bench.gemm import SHAPES
from services.modeling.kernels import cpu_arch, cpu_kernels, dense_linear, pack_dense

LM_HEADS = {"smollm2": (49152, 576), "1b-class": (32000, 2048)}
LAYERS = {"smollm2": 30, "1b-class": 16}
SEQUENCE_ROWS = (1, 16)
KERNELS = ("onednn", "nk", "packed")


def medians(fns: dict, passes: int) -> dict[str, float]:
    """Median seconds per call of each function, their passes interleaved."""
    for fn in fns.values():
        fn()
    start = time.perf_counter()
    next(iter(fns.values()))()
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(passes):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(n: int, k: int, rows: int, passes: int) -> dict:
    gen = torch.Generator().manual_seed(rows + n + k)
    w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    packed = pack_dense(w)
    seconds = medians({"onednn": lambda: F.linear(x, w), "nk": lambda: dense_linear(x, w),
                       "packed": lambda: dense_linear(x, packed)}, passes)
    gflops = {name: 2 * rows * n * k / s / 1e9 for name, s in seconds.items()}
    ref = F.linear(x.float(), w.float())
    err = ((dense_linear(x, packed).float() - ref).abs().max() / ref.abs().max()).item()
    return {"n": n, "k": k, "rows": rows, **{f"{name}_gflops": g for name, g in gflops.items()},
            "packed_vs_onednn": gflops["packed"] / gflops["onednn"], "packed_vs_nk": gflops["packed"] / gflops["nk"],
            "packed_max_rel_err": err}


def measure_sequence(model: str, rows: int, passes: int) -> dict:
    """Every weight of ``model`` once, in the order a step reads them, on each layout."""
    gen = torch.Generator().manual_seed(LAYERS[model])
    shapes = [shape for _ in range(LAYERS[model]) for shape in SHAPES[model].values()] + [LM_HEADS[model]]
    nk = [(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for n, k in shapes]
    packed = [pack_dense(w) for w in nk]
    xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in shapes}

    def run(weights):
        for (_, k), w in zip(shapes, weights, strict=True):
            dense_linear(xs[k], w)

    seconds = medians({"nk": lambda: run(nk), "packed": lambda: run(packed)}, passes)
    nbytes = sum(w.numel() * w.element_size() for w in nk)
    return {"model": model, "rows": rows, "bytes": nbytes, "nk_ms": seconds["nk"] * 1e3,
            "packed_ms": seconds["packed"] * 1e3, "nk_gb_s": nbytes / seconds["nk"] / 1e9,
            "packed_gb_s": nbytes / seconds["packed"] / 1e9, "packed_speedup": seconds["nk"] / seconds["packed"]}


def markdown(payload: dict) -> str:
    lines = [f"# `dense_linear` on the packed weight vs the [N, K] rows and oneDNN (`{payload['name']}`)", "",
             f"Machine: {payload['machine']}; kernels built for `-march={payload['arch']}`. Command: "
             f"`{payload['command']}`. GFLOP/s, medians of "
             f"{payload['passes']} interleaved passes.", "",
             "| shape | rows | oneDNN | [N, K] kernel | packed kernel | packed / oneDNN | packed / [N, K] "
             "| max rel. error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        lines.append(f"| {r['shape']} ({r['n']}×{r['k']}) | {r['rows']} | {r['onednn_gflops']:.0f} | "
                     f"{r['nk_gflops']:.0f} | {r['packed_gflops']:.0f} | {r['packed_vs_onednn']:.2f} | "
                     f"{r['packed_vs_nk']:.2f} | {r['packed_max_rel_err']:.1e} |")
    lines += ["", "A model's whole sequence of weights, cold (milliseconds per pass; bytes read per second):", "",
              "| model | rows | weights | [N, K] kernel | packed kernel | speed-up |", "|---|---|---|---|---|---|"]
    for r in payload["sequences"]:
        lines.append(f"| {r['model']} | {r['rows']} | {r['bytes'] / 1e6:.0f} MB | {r['nk_ms']:.2f} ms "
                     f"({r['nk_gb_s']:.1f} GB/s) | {r['packed_ms']:.2f} ms ({r['packed_gb_s']:.1f} GB/s) | "
                     f"{r['packed_speedup']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gemm_packed", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64,256,1024")
    parser.add_argument("--shapes", default="1b-class,smollm2")
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--name", default="gemm-packed")
    args = parser.parse_args(argv)
    probe = torch.ones(16, 2, dtype=torch.bfloat16)
    if cpu_kernels() is None or pack_dense(probe) is probe:
        print("dense weights stay [N, K] here (no AVX512-BF16, AMX tiles, or kernels off): nothing to compare",
              file=sys.stderr)
        return 2
    results = []
    for model in args.shapes.split(","):
        for shape, (n, k) in {**SHAPES[model], "lm_head": LM_HEADS[model]}.items():
            for rows in map(int, args.rows.split(",")):
                r = {"shape": f"{model} {shape}", **measure(n, k, rows, args.passes)}
                print(r, flush=True)
                results.append(r)
    sequences = []
    for model in args.shapes.split(","):
        for rows in SEQUENCE_ROWS:
            r = measure_sequence(model, rows, args.passes)
            print(r, flush=True)
            sequences.append(r)
    payload = {"name": args.name, "machine": machine(), "arch": cpu_arch(),
               "command": "python -m bench.gemm_packed " + " ".join(argv if argv is not None else sys.argv[1:]),
               "passes": args.passes, "results": results, "sequences": sequences}
    return publish_results(args.name, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
