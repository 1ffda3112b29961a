"""`shardline generate`: run one completion on a locally launched replica group."""

from __future__ import annotations

import argparse

from services.cli.score import exit_code_for, parse_ids, print_result
from services.common.sampling import SamplingParams
from services.worker.engine.bootstrap import encode_prompt, generate_rank
from services.worker.launch import run_replica_group
from services.worker.options import add_engine_arguments, add_layout_arguments, engine_spec
from services.worker.runtime import stage_tokenizer_dir


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
    with exit_code_for("generate") as failed:
        spec = engine_spec(args)
        ids = (parse_ids(args.prompt_ids) if args.prompt_ids
               else encode_prompt(stage_tokenizer_dir(spec), args.prompt))
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        [completion] = run_replica_group(spec.plan.world_size, generate_rank, spec, [ids], [params],
                                         failure_grace_s=args.collective_timeout + 3.0, fork=True)  # no tensor op yet
    if failed:
        return failed.code
    return print_result(completion, as_json=args.json, text=completion.text)
