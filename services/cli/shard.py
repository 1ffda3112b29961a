"""`shardline shard`: cut an HF checkpoint into per-rank safetensors shards plus manifest.json,
with the model's config and tokenizer files copied beside them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.common.errors import ShardlineError
from services.loader.writer import ShardJob, write_shards
from services.modeling.weights import CheckpointError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("shard", help="cut an HF checkpoint into per-rank shards with a manifest")
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel degree")
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel degree")
    parser.add_argument("--dtype", default=None,
                        help="float32 | bfloat16 | float16 | int8 | fp8 (int8/fp8: linear weights quantized per "
                             "output channel, with float32 scales; default: the checkpoint's own dtype)")
    parser.add_argument("--activation-dtype", default=None,
                        help="activations of an int8/fp8 checkpoint: bfloat16 (default) | float32")
    parser.add_argument("--out", required=True, help="output directory or s3://bucket/prefix")
    parser.add_argument("--name", default=None, help="model name in the manifest (default: the directory's name)")
    parser.add_argument("--endpoint-url", default=None,
                        help="S3-compatible endpoint (default $SHARDLINE_S3_ENDPOINT_URL, else AWS)")
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always show a progress bar (default: only on a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")
    parser.add_argument("--json", action="store_true", help="print the manifest summary as one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        job = ShardJob(args.model, args.tp, args.pp, args.out, dtype=args.dtype, model_name=args.name,
                       activation_dtype=args.activation_dtype)
        manifest = write_shards(job, endpoint_url=args.endpoint_url, progress=args.progress)
    except (ValueError, FileNotFoundError, CheckpointError, ShardlineError) as exc:
        print(f"shardline shard: {exc}", file=sys.stderr)
        return 2
    summary = {"out": args.out, "model_name": manifest.model_name, "model_fingerprint": manifest.model_fingerprint,
               "plan": manifest.plan.to_dict(), "total_bytes": manifest.total_bytes,
               "shards": [{"file": s.file, "bytes": s.bytes, "sha256": s.sha256} for s in manifest.shards],
               "model_files": [f.to_dict() for f in manifest.model_files]}
    if args.json:
        print(json.dumps(summary))
    else:
        files = ", ".join(f.file for f in manifest.model_files) or "none"
        print(f"wrote {len(manifest.shards)} shard(s), {manifest.total_bytes:,} bytes, to {args.out} "
              f"({manifest.plan.describe()}); model files: {files}; manifest.json last")
    return 0
