"""KV-cache sizing and allocation for one rank of a replica group.

A rank stores keys and values only for its own layers (its pipeline stage) and its own KV heads
(its TP shard), so per token it needs

    kv_bytes_per_token_per_rank = 2 (K and V) · layers_on_stage · kv_heads_per_rank · head_dim · dtype_bytes

where ``kv_heads_per_rank = kv_heads / tp`` (1 when TP exceeds the KV heads, which are then
replicated). Example: Llama-3-70B (80 layers, 8 KV heads) at TP4/PP2 in fp16 stores
2·40·2·128·2 = 40,960 B per token per rank, and a 20 GiB budget holds 524,288 tokens.

Every rank of a group must hold the *same* number of blocks: the driver's one block allocator
hands out block ids that index every rank's tensors. With an uneven pipeline split the stages
differ in layers, so the block count is computed for the *fullest* stage (the one with the most
bytes per token): that stage uses its whole budget and the others use less, and no rank exceeds
its budget.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
from torch import nn

from services.common.dtypes import DENSE_DTYPES, canonical_dtype
from services.modeling.config import ModelConfigError, torch_dtype
from services.modeling.parallel.plan import ParallelPlan

GiB = 1024**3


class KVCacheTooSmall(ValueError):
    """The byte budget does not hold a single block on the fullest stage."""


@dataclass(frozen=True)
class CacheConfig:
    """How much KV cache each rank gets. ``dtype`` None means the model's activation dtype (a
    quantized plan's KV cache is in its activation dtype, not int8/fp8);
    ``num_blocks`` overrides the count derived from ``kv_cache_bytes`` (tests, benchmarks)."""

    block_size: int = 16
    kv_cache_bytes: int = 20 * GiB
    dtype: str | None = None
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be an integer >= 1, got {self.kv_cache_bytes!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be an integer >= 1 or None, got {self.num_blocks!r}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype, DENSE_DTYPES, error=ModelConfigError))

    def resolved_dtype(self, plan: ParallelPlan) -> str:
        return self.dtype or plan.activation_dtype


def dtype_bytes(dtype: str) -> int:
    return torch_dtype(dtype).itemsize


def kv_bytes_per_token_per_rank(plan: ParallelPlan, pp_stage: int, *, dtype: str | None = None) -> int:
    """2 · layers_on_stage · kv_heads_per_rank · head_dim · dtype_bytes (dtype: the plan's activations')."""
    if not 0 <= pp_stage < plan.pp_degree:
        raise ValueError(f"pp_stage must be in [0, {plan.pp_degree}), got {pp_stage}")
    layers = len(plan.stage_layers(pp_stage))
    return 2 * layers * plan.kv_heads_per_rank * plan.config.head_dim * dtype_bytes(dtype or plan.activation_dtype)


def max_kv_bytes_per_token_per_rank(plan: ParallelPlan, *, dtype: str | None = None) -> int:
    """Bytes per token on the fullest stage's ranks (what sizes every rank's block count)."""
    return max(kv_bytes_per_token_per_rank(plan, s, dtype=dtype) for s in range(plan.pp_degree))


def num_blocks_for_budget(plan: ParallelPlan, cache: CacheConfig) -> int:
    """Blocks every rank of the group allocates: ``kv_cache_bytes // (block_size · bytes per
    token on the fullest stage)``, or ``cache.num_blocks`` when set. Raises
    ``KVCacheTooSmall`` if the budget holds no block."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_token = max_kv_bytes_per_token_per_rank(plan, dtype=cache.resolved_dtype(plan))
    per_block = per_token * cache.block_size
    blocks = cache.kv_cache_bytes // per_block
    if blocks < 1:
        raise KVCacheTooSmall(
            f"kv_cache_bytes={cache.kv_cache_bytes} holds no KV block: one block of "
            f"{cache.block_size} tokens needs {per_block} bytes on the fullest stage "
            f"({per_token} bytes per token)")
    return blocks


@dataclass(frozen=True)
class KVCacheLayout:
    """The group-wide KV geometry: what the driver's allocator and its stats need."""

    num_blocks: int
    block_size: int
    dtype: str
    bytes_per_token: int  # per rank, on the fullest stage

    @classmethod
    def for_plan(cls, plan: ParallelPlan, cache: CacheConfig) -> KVCacheLayout:
        dtype = cache.resolved_dtype(plan)
        return cls(num_blocks=num_blocks_for_budget(plan, cache), block_size=cache.block_size,
                   dtype=dtype, bytes_per_token=max_kv_bytes_per_token_per_rank(plan, dtype=dtype))

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def capacity_bytes(self) -> int:
        """Bytes the fullest stage's ranks allocate."""
        return self.num_blocks * self.bytes_per_block

    def bytes_for_blocks(self, n_blocks: int) -> int:
        return n_blocks * self.bytes_per_block


def allocate_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> int:
    """Give every attention layer of this stage's ``model`` its ``kv_cache = (k, v)``, each
    ``[num_blocks, block_size, kv_heads_local, head_dim]``; returns the bytes allocated.

    The tensors are zero-filled, not empty: attention gathers whole blocks and masks the
    positions past a context, and a masked NaN would still poison the output (0 · NaN = NaN).
    On the CPU the zeros are an anonymous mapping's (:func:`zeroed`): none is written here.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
    layers = model.attention_layers()
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layers to give a KV cache")
    total = 0
    for layer in layers:
        shape = (num_blocks, block_size, layer.kv_heads, layer.head_dim)
        k = zeroed(shape, dtype, device)
        v = zeroed(shape, dtype, device)
        layer.kv_cache = (k, v)
        total += k.numel() * k.element_size() + v.numel() * v.element_size()
    return total


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros. On the CPU they are the pages of an anonymous mapping, which the kernel gives zeroed
    when each is first written: ``torch.zeros`` wrote all of them at once, 0.84 CPU-seconds for
    the default 1 GiB per rank on the AVX2 EPYC, every start, and held the memory of blocks no
    sequence had used yet. The tensor keeps the mapping alive."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, math.prod(shape) * dtype.itemsize), dtype=dtype).view(shape)


def free_kv_cache(model: nn.Module) -> None:
    """Drop every attention layer's KV tensors (the model falls back to no-cache attention)."""
    for layer in model.attention_layers():
        layer.kv_cache = None
