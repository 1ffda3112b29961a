"""`shardline score`: per-token log-probabilities of a text or ids under a sharded model."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ShardlineError
from services.modeling.config import ModelConfigError
from services.worker.engine.bootstrap import encode_prompt
from services.worker.launch import ReplicaGroupFailed, run_replica_group
from services.worker.options import add_layout_arguments, rank_spec
from services.worker.runtime import stage_tokenizer_dir
from services.worker.scoring import score_rank


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("score", help="score a text or token ids (prompt log-probabilities)")
    add_layout_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="text, tokenized with the model's tokenizer.json")
    source.add_argument("--text-file", type=Path, help="file whose text is scored")
    source.add_argument("--ids", help="comma-separated token ids")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def parse_ids(value: str) -> list[int]:
    """``"1, 2,3"`` -> ``[1, 2, 3]`` (blank entries skipped)."""
    return [int(tok) for tok in value.split(",") if tok.strip()]


@dataclass
class Failure:
    code: int = 0

    def __bool__(self) -> bool:
        return self.code != 0


@contextlib.contextmanager
def exit_code_for(command: str) -> Iterator[Failure]:
    """Runs a local-group command's body: bad input (exit 2) or a failed group (exit 1) is
    printed as ``shardline COMMAND: message`` and recorded in the yielded Failure."""
    failure = Failure()
    try:
        yield failure
    except (ModelConfigError, ShardlineError, FileNotFoundError) as exc:
        print(f"shardline {command}: {exc}", file=sys.stderr)
        failure.code = 2
    except ReplicaGroupFailed as exc:
        print(f"shardline {command}: {exc}", file=sys.stderr)
        failure.code = 1


def print_result(result, *, as_json: bool, text: str) -> int:
    """One JSON object (``result.to_dict()``) with --json, else ``text``; exit code 0."""
    print(json.dumps(result.to_dict()) if as_json else text)
    return 0


def run(args: argparse.Namespace) -> int:
    with exit_code_for("score") as failed:
        spec = rank_spec(args)
        plan = spec.plan
        if args.ids:
            ids = parse_ids(args.ids)
        else:
            text = args.text if args.text is not None else args.text_file.read_text()
            ids = encode_prompt(stage_tokenizer_dir(spec), text)
        if len(ids) < 2:
            raise ModelConfigError(f"need at least 2 tokens to score, got {len(ids)}")
        if len(ids) > plan.config.max_position_embeddings:
            raise ModelConfigError(f"{len(ids)} tokens exceed max_position_embeddings="
                                   f"{plan.config.max_position_embeddings}")
        bad = [t for t in ids if not 0 <= t < plan.config.vocab_size]
        if bad:
            raise ModelConfigError(f"token ids {bad[:5]} outside the vocabulary [0, {plan.config.vocab_size})")
        result = run_replica_group(plan.world_size, score_rank, spec, ids,
                                   failure_grace_s=args.collective_timeout + 3.0, fork=True)  # no tensor op yet
    if failed:
        return failed.code
    return print_result(result, as_json=args.json,
                        text=f"tokens {result.n_tokens}  nll {result.nll:.4f}  perplexity {result.perplexity:.3f}")
