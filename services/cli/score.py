"""`shardline score`: per-token log-probabilities of a text or ids under a sharded model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.common.errors import ShardlineError
from services.modeling.config import ModelConfigError


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory (or give --checkpoint)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: the directory name)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    parser.add_argument("--checkpoint", default=None,
                        help="manifest.json of a pre-sharded checkpoint (path or s3://…): the fast path")
    parser.add_argument("--dtype", default=None,
                        help="float32 | bfloat16 | float16 (default float32, or the checkpoint's dtype)")
    parser.add_argument("--collective-timeout", type=float, default=2.0,
                        help="seconds before a hung collective fails the group (default 2)")
    parser.add_argument("--replica-group-id", default="local", help="name of this replica group")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("score", help="score a text or token ids (prompt log-probabilities)")
    add_layout_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="text, tokenized with the model's tokenizer.json")
    source.add_argument("--text-file", type=Path, help="file whose text is scored")
    source.add_argument("--ids", help="comma-separated token ids")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def encode_prompt(model_dir: str | None, text: str) -> list[int]:
    from tokenizers import Tokenizer

    path = Path(model_dir or ".") / "tokenizer.json"
    if not path.exists():
        raise ModelConfigError(f"{path} not found: pass --ids, or give the model a tokenizer.json")
    return Tokenizer.from_file(str(path)).encode(text).ids


def run(args: argparse.Namespace) -> int:
    from services.worker.launch import ReplicaGroupFailed, run_replica_group
    from services.worker.runtime import RankSpec
    from services.worker.scoring import score_rank

    try:
        spec = RankSpec(args.model, args.tp, args.pp, args.dtype, args.replica_group_id, args.collective_timeout,
                        args.checkpoint)
        plan = spec.plan()
        if args.ids:
            ids = [int(tok) for tok in args.ids.split(",") if tok.strip()]
        else:
            text = args.text if args.text is not None else args.text_file.read_text()
            ids = encode_prompt(spec.tokenizer_dir, text)
        if len(ids) < 2:
            raise ModelConfigError(f"need at least 2 tokens to score, got {len(ids)}")
        if len(ids) > plan.config.max_position_embeddings:
            raise ModelConfigError(f"{len(ids)} tokens exceed max_position_embeddings="
                                   f"{plan.config.max_position_embeddings}")
        bad = [t for t in ids if not 0 <= t < plan.config.vocab_size]
        if bad:
            raise ModelConfigError(f"token ids {bad[:5]} outside the vocabulary [0, {plan.config.vocab_size})")
        result = run_replica_group(plan.world_size, score_rank, spec, ids,
                                   failure_grace_s=args.collective_timeout + 3.0)
    except (ModelConfigError, ShardlineError, FileNotFoundError) as exc:
        print(f"shardline score: {exc}", file=sys.stderr)
        return 2
    except ReplicaGroupFailed as exc:
        print(f"shardline score: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"tokens {result.n_tokens}  nll {result.nll:.4f}  perplexity {result.perplexity:.3f}")
    return 0
