"""The worker's command-line flags and the spec built from them.

``shardline serve worker``, ``shardline generate`` and ``shardline score`` take the same layout
flags (model, TP, PP, dtype, checkpoint) and the first two the same engine flags (KV cache,
scheduler limits), so they are declared once here.
"""

from __future__ import annotations

import argparse

from services.common.numerics import DEFAULT_NUMERICS, NUMERICS
from services.modeling.parallel.groups import DEVICES, resolve_device
from services.worker.engine.kv_cache import CacheConfig
from services.worker.engine.scheduler import SchedulerConfig
from services.worker.runtime import CPU_DEFAULT_KV_CACHE_BYTES, RankSpec


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory (or give --checkpoint)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: the directory name)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    parser.add_argument("--checkpoint", default=None,
                        help="manifest.json of a pre-sharded checkpoint (path or s3://…): the fast path")
    parser.add_argument("--dtype", default=None,
                        help="float32 | bfloat16 | float16 | int8 | fp8 (default float32, or the checkpoint's "
                             "dtype); int8/fp8 quantize the linear weights on load from --model")
    parser.add_argument("--activation-dtype", default=None,
                        help="activations and KV cache of an int8/fp8 plan: bfloat16 (default) | float32")
    parser.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                        help="layout-invariant (default): every layout-dependent sum in one fixed order, so a TP "
                             "degree up to 8 gives the same bits as any other (row-parallel layers in fixed "
                             "k-chunks); per-layout: the backend's all-reduce order (needed above TP 8)")
    parser.add_argument("--collective-timeout", type=float, default=2.0,
                        help="seconds before a hung collective fails the group (default 2)")
    parser.add_argument("--replica-group-id", default="local", help="name of this replica group")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the ranks run: cuda (one GPU per rank, NCCL), cpu (gloo), or auto (default: "
                             "cuda when torch sees a GPU)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="KV cache budget per rank in GiB (default 1 on the CPU, the plan's 20 on a GPU)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    limits = SchedulerConfig()
    parser.add_argument("--max-num-seqs", type=int, default=limits.max_num_seqs,
                        help=f"most sequences running at once (default {limits.max_num_seqs})")
    parser.add_argument("--max-batched-tokens", type=int, default=limits.max_batched_tokens,
                        help=f"token budget per step (chunked prefill; default {limits.max_batched_tokens})")
    cap = limits.max_prefill_tokens_with_decodes
    parser.add_argument("--max-prefill-tokens-with-decodes", type=int, default=cap,
                        help="while any sequence decodes, a step's prefill chunks take at most this many tokens "
                             f"(bounds the gap between decoded tokens; default {cap})")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion (default: the model's max_position_embeddings)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="prefill every prompt from its first token (default: a prompt whose leading blocks "
                             "of tokens are cached reuses their keys and values)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every decode step eagerly instead of replaying CUDA graphs (a group on one GPU "
                             "captures one graph per batch-size bucket by default)")


def rank_spec(args: argparse.Namespace, **engine: object) -> RankSpec:
    """The layout flags as a spec; resolves the plan (a bad layout raises here)."""
    return RankSpec(args.model, tp_degree=args.tp, pp_degree=args.pp, dtype=args.dtype,
                    activation_dtype=getattr(args, "activation_dtype", None),
                    replica_group_id=args.replica_group_id, collective_timeout_s=args.collective_timeout,
                    checkpoint=args.checkpoint, device=getattr(args, "device", "auto"),
                    numerics=getattr(args, "numerics", DEFAULT_NUMERICS), **engine)


def engine_spec(args: argparse.Namespace) -> RankSpec:
    """The layout and engine flags as a spec (``shardline serve worker``, ``shardline generate``)."""
    if args.kv_cache_gb is not None:
        cache = CacheConfig(block_size=args.block_size, kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)))
    elif resolve_device(getattr(args, "device", "auto")) == "cpu":
        cache = CacheConfig(block_size=args.block_size, kv_cache_bytes=CPU_DEFAULT_KV_CACHE_BYTES)
    else:  # a GPU: CacheConfig's own default, the plan's budget
        cache = CacheConfig(block_size=args.block_size)
    return rank_spec(args, cache=cache, max_num_seqs=args.max_num_seqs,
                     max_batched_tokens=args.max_batched_tokens,
                     max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
                     max_model_len=args.max_model_len,
                     cuda_graphs=not args.enforce_eager, prefix_caching=args.prefix_caching)
