"""`shardline generate`: run one completion on a locally launched replica group."""

from __future__ import annotations

import argparse
import json
import sys

from services.cli.score import add_layout_arguments, encode_prompt
from services.common.errors import ShardlineError
from services.modeling.config import ModelConfigError


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-gb", type=float, default=1.0,
                        help="KV cache budget per rank in GiB (default 1; the plan's 20 GiB on GPUs)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    parser.add_argument("--max-batched-tokens", type=int, default=2048,
                        help="token budget per step (chunked prefill)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion (default: the model's max_position_embeddings)")


def engine_spec(args: argparse.Namespace):
    from services.worker.engine.group import EngineSpec
    from services.worker.engine.kv_cache import CacheConfig
    from services.worker.runtime import RankSpec

    rank = RankSpec(args.model, args.tp, args.pp, args.dtype, args.replica_group_id, args.collective_timeout,
                    args.checkpoint)
    cache = CacheConfig(block_size=args.block_size, kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)))
    return EngineSpec(rank, cache, args.max_num_seqs, args.max_batched_tokens, args.max_model_len)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate a completion on a local replica group")
    add_layout_arguments(parser)
    add_engine_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (the model's tokenizer)")
    source.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.worker.engine.group import generate_rank
    from services.worker.engine.sequence import SamplingParams
    from services.worker.launch import ReplicaGroupFailed, run_replica_group

    try:
        spec = engine_spec(args)
        plan = spec.rank.plan()
        ids = ([int(t) for t in args.prompt_ids.split(",") if t.strip()] if args.prompt_ids
               else encode_prompt(spec.rank.tokenizer_dir, args.prompt))
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        [completion] = run_replica_group(plan.world_size, generate_rank, spec, [ids], [params],
                                         failure_grace_s=args.collective_timeout + 3.0)
    except (ModelConfigError, ShardlineError, FileNotFoundError) as exc:
        print(f"shardline generate: {exc}", file=sys.stderr)
        return 2
    except ReplicaGroupFailed as exc:
        print(f"shardline generate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(completion.to_dict()))
    else:
        print(completion.text)
    return 0
