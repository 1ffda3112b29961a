"""`shardline quantize`: a calibrated (GPTQ) copy of an HF model directory for an int8 or fp8 plan.

    shardline quantize --model .models/smollm2 --dtype fp8 --out .models/smollm2-fp8-gptq
    shardline up --model .models/smollm2-fp8-gptq --dtype fp8

The copy loads like any model directory; as ``--dtype fp8`` (or the dtype it was made for) its
weights quantize back to exactly the codes the calibration chose (services/worker/calibration.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.common.dtypes import lookup_dtype
from services.modeling.quant import scheme_for
from services.worker.calibration import DEFAULT_CALIBRATION_CHUNKS, DEFAULT_CALIBRATION_TOKENS, quantize_model_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("quantize", help="write a GPTQ-calibrated copy of a model for an int8/fp8 plan")
    parser.add_argument("--model", type=Path, required=True, help="HF model directory (safetensors)")
    parser.add_argument("--dtype", required=True, help="int8 or fp8: the scheme the copy is calibrated for")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the copy to")
    parser.add_argument("--lm-head", choices=("quantized", "dense"), default="quantized",
                        help="calibrate the lm_head (a tied embedding table with it) too, as the plan "
                             "quantizes it (default quantized)")
    parser.add_argument("--chunks", type=int, default=DEFAULT_CALIBRATION_CHUNKS,
                        help=f"calibration chunks (default {DEFAULT_CALIBRATION_CHUNKS})")
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS,
                        help=f"tokens per calibration chunk (default {DEFAULT_CALIBRATION_TOKENS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        scheme = scheme_for(lookup_dtype(args.dtype) or "")
        if scheme is None:
            raise ValueError(f"--dtype is int8 or fp8, got {args.dtype!r}")
        if args.out.resolve() == args.model.resolve():
            raise ValueError("--out must be another directory than --model")
        if args.chunks < 1 or args.chunk_tokens < 2:
            raise ValueError("--chunks must be >= 1 and --chunk-tokens >= 2")
        if not (args.model / "config.json").exists():
            raise FileNotFoundError(f"{args.model}: no config.json (an HF model directory is needed)")
        report = quantize_model_dir(args.model, args.out, scheme, quantize_lm_head=args.lm_head == "quantized",
                                    chunks=args.chunks, chunk_tokens=args.chunk_tokens)
    except (ValueError, FileNotFoundError) as exc:
        print(f"shardline quantize: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(f"shardline quantize: {report.tensors} tensors calibrated for {scheme.name} on "
              f"{report.calibration_tokens:,} tokens in {report.seconds:.0f} s -> {report.out_dir}")
    return 0
