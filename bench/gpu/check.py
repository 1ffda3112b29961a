"""The CUDA path, checked and measured in one run: ``python -m bench.gpu.check``.

On a GPU (``--device cuda``, the default where torch sees one) it (a) checks correctness on the
device against transformers (bench/gpu/correctness.py: the tiny model and SmolLM2 at TP1 in
float32 and bfloat16, greedy output, batching invariance, CUDA graphs against eager steps, and
the int8 / fp8 plans against bfloat16), (b) measures decode of Llama-3-8B- and 70B-shaped models
with random weights made on the GPU (bench/gpu/decode.py: bfloat16 8B, fp8 8B and 70B, at batch
1, 16 and 64) against the HBM roofline, and (c) writes ``gpu.json`` and ``gpu.md`` (default
bench/results/). Exit status 1 when a required check fails.

It needs only torch, transformers, safetensors and tokenizers (what the lent GPU machine's
image has: bench/gpu/fetch_wheels.sh says so and checks it), and runs in a few minutes there.
``--device cpu --quick`` runs the same code on the CPU with the tiny model and a tiny shape
(``make test`` does, so the script never rots); its figures say nothing about a GPU.

The target the 70B figures are held against: fp8 at batch 1 at most 18.5 ms per token (80 % of
the HBM roofline or better) on one GPU.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, write_results
from bench.gpu import correctness, decode
from services.modeling.parallel.groups import DEVICES, resolve_device

TARGET = {"shape": "llama3-70b", "dtype": "fp8", "batch": 1, "tpot_ms": 18.5}
FULL = {"cases": [("llama3-8b", "bfloat16"), ("llama3-8b", "fp8"), ("llama3-70b", "fp8")], "batches": (1, 16, 64),
        "prompt_len": 128, "warmup": 3, "steps": 32, "bandwidth_bytes": 4 << 30}
QUICK = {"cases": [("tiny", "bfloat16"), ("tiny", "fp8")], "batches": (1, 4), "prompt_len": 16, "warmup": 2,
         "steps": 6, "bandwidth_bytes": 256 << 20}


def device_name(device: str) -> str:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor})"
    return platform.processor() or platform.machine()


def run_decode(device: str, plan: dict) -> tuple[float, list[decode.DecodeRow]]:
    bandwidth = decode.copy_bandwidth(device, plan["bandwidth_bytes"])
    rows: list[decode.DecodeRow] = []
    for shape, dtype in plan["cases"]:
        rows += decode.measure(shape, decode.shape_config(shape), dtype, device, batches=plan["batches"],
                               prompt_len=plan["prompt_len"], steps=plan["steps"], warmup=plan["warmup"],
                               bandwidth=bandwidth)
        done = rows[-len(plan["batches"]):]
        print(f"decode {shape} {dtype}: " + ", ".join(
            f"batch {r.batch} {r.tpot_ms:.2f} ms ({r.step_over_roofline:.2f}x roofline)" for r in done), flush=True)
    return bandwidth, rows


def target_row(rows: list[decode.DecodeRow]) -> dict | None:
    for r in rows:
        if (r.shape, r.dtype, r.batch) == (TARGET["shape"], TARGET["dtype"], TARGET["batch"]):
            return {**TARGET, "measured_ms": r.tpot_ms, "met": r.tpot_ms <= TARGET["tpot_ms"],
                    "roofline_fraction": 1 / r.step_over_roofline}
    return None


def markdown(payload: dict) -> str:
    quick = "; quick (CPU) mode: the figures say nothing about a GPU" if payload["quick"] else ""
    lines = [f"# The CUDA path: {payload['device_name']}", "",
             f"`python -m bench.gpu.check {' '.join(payload['argv'])}` — torch {payload['torch']}, CUDA "
             f"{payload['cuda']}{quick}.", "",
             f"Correctness: **{'passed' if payload['passed'] else 'FAILED'}** "
             f"({sum(c['passed'] for c in payload['correctness'])} of {len(payload['correctness'])} checks).", "",
             "| model | dtype | check | value | bound | passed | required | detail |",
             "|---|---|---|---|---|---|---|---|"]
    for c in payload["correctness"]:
        bound = "" if c["bound"] is None else f"{c['bound']:g}"
        lines.append(f"| {c['model']} | {c['dtype']} | {c['name']} | {c['value']:.3g} | {bound} | "
                     f"{'yes' if c['passed'] else 'NO'} | {'yes' if c['required'] else 'no'} | "
                     f"{c['detail'].replace('|', chr(92) + '|')} |")
    lines += ["", f"Decode (random weights made on the device; copy bandwidth {payload['bandwidth_gb_s']:.0f} GB/s, "
              "read + write):", "",
              "| shape | dtype | batch | TPOT ms | tokens/s | weights read GB | roofline ms | step / roofline |",
              "|---|---|---|---|---|---|---|---|"]
    for r in payload["decode"]:
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['batch']} | {r['tpot_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['weight_gb']:.3g} | {r['roofline_ms']:.3g} | {r['step_over_roofline']:.2f} |")
    t = payload.get("target")
    if t:
        lines += ["", f"Target: {t['shape']} {t['dtype']} at batch {t['batch']} ≤ {t['tpot_ms']} ms per token: "
                  f"**{t['measured_ms']:.2f} ms ({'met' if t['met'] else 'not met'})**, "
                  f"{100 * t['roofline_fraction']:.0f} % of the roofline."]
    lines += ["", "Seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in payload["seconds"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--quick", action="store_true", help="the tiny model and a tiny shape only (the CPU mode)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="where gpu.json and gpu.md go (default bench/results)")
    parser.add_argument("--smollm2", type=Path, default=None,
                        help="SmolLM2's HF directory (default: random weights of its shape)")
    parser.add_argument("--skip-decode", action="store_true", help="correctness only")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if device == "cpu" and not args.quick:
        parser.error("the full run (8B and 70B shapes) needs a GPU: on the CPU pass --quick")
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        models = correctness.make_models(Path(tmp), quick=args.quick, smollm2_dir=args.smollm2)
        checks = correctness.run(models, device, quick=args.quick)
    seconds["correctness"] = time.monotonic() - t0
    for c in checks:
        print(f"{'ok  ' if c.passed else 'FAIL'} {c.model} {c.dtype} {c.name}: {c.value:.3g} (bound {c.bound}) "
              f"{c.detail}", flush=True)
    bandwidth, rows = 0.0, []
    if not args.skip_decode:
        t1 = time.monotonic()
        bandwidth, rows = run_decode(device, QUICK if args.quick else FULL)
        seconds["decode"] = time.monotonic() - t1
    payload = {"device": device, "device_name": device_name(device), "torch": torch.__version__,
               "cuda": torch.version.cuda, "quick": args.quick, "argv": argv,
               "passed": all(c.passed for c in checks if c.required), "bandwidth_gb_s": bandwidth / 1e9,
               "correctness": [c.as_dict() for c in checks], "decode": [r.as_dict() for r in rows],
               "target": target_row(rows), "seconds": seconds}
    json_path, md_path = write_results("gpu", payload, markdown(payload), out_dir=args.out)
    print(f"wrote {json_path} and {md_path}; correctness {'passed' if payload['passed'] else 'FAILED'}")
    return 0 if payload["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
