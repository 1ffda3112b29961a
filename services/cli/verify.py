"""`shardline verify`: check a sharded checkpoint's bytes, headers and layout (against a plan)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.loader.layout import model_fingerprint
from services.loader.verify import read_manifest, verify_checkpoint
from services.modeling.config import ModelConfig, ModelConfigError
from services.modeling.parallel.plan import ParallelPlan


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("verify", help="verify a sharded checkpoint against its manifest and a plan")
    parser.add_argument("--manifest", required=True, help="manifest.json path, its directory, or s3://… URI")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree the worker runs")
    parser.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree the worker runs")
    parser.add_argument("--dtype", default=None, help="dtype the worker runs (default: the checkpoint's)")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF directory the checkpoint must have been cut from (config and fingerprint)")
    parser.add_argument("--endpoint-url", default=None,
                        help="S3-compatible endpoint (default $SHARDLINE_S3_ENDPOINT_URL, else AWS)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    def fail(exc: Exception, code: int) -> int:
        if args.json:
            print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}))
        print(f"shardline verify: {exc}", file=sys.stderr)
        return code

    try:
        plan = None
        fingerprint = model_fingerprint(args.model) if args.model is not None else None
        if args.tp is not None or args.pp is not None or args.dtype is not None or args.model is not None:
            manifest, _ = read_manifest(args.manifest, endpoint_url=args.endpoint_url)
            config = (ModelConfig.from_dir(args.model) if args.model is not None else
                      ModelConfig.from_dict(manifest.model_config, name=manifest.model_name))
            plan = ParallelPlan(config, args.tp or 1, args.pp or 1, args.dtype or manifest.plan.dtype)

        def shown(check) -> None:
            if not args.json:
                print(f"ok  {check.file}  {check.bytes:,} bytes  sha256 {check.sha256[:16]}…")

        report = verify_checkpoint(args.manifest, plan=plan, expected_fingerprint=fingerprint,
                                   endpoint_url=args.endpoint_url, on_shard=shown, on_model_file=shown)
    except (FailedPrecondition, InvalidArgument) as exc:
        return fail(exc, 1)
    except (NotFound, FileNotFoundError, ModelConfigError) as exc:
        return fail(exc, 2)
    m = report.manifest
    against = f"plan tp={plan.tp_degree} pp={plan.pp_degree} dtype={plan.dtype}" if plan else "its own plan"
    if args.json:
        print(json.dumps({"ok": True, "model_name": m.model_name, "model_fingerprint": m.model_fingerprint,
                          "plan": m.plan.to_dict(), "checked_against": against, "total_bytes": report.total_bytes,
                          "shards": [{"file": s.file, "bytes": s.bytes, "sha256": s.sha256} for s in report.shards],
                          "model_files": [{"file": f.file, "bytes": f.bytes, "sha256": f.sha256}
                                          for f in report.model_files]}))
    else:
        files = f" and {len(report.model_files)} model file(s)" if report.model_files else ""
        print(f"verified {len(report.shards)} shard(s), {report.total_bytes:,} bytes of {m.model_name} "
              f"({m.plan.describe()}){files} against {against}")
    return 0
