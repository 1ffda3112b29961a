"""Tensor-parallel layers, built already sharded (Megatron-LM; vLLM's layer style).

Each parameter carries ``weight_loader(target, source, shard_id=None)``: it takes the *full*
checkpoint tensor — a ``torch.Tensor`` or a safetensors ``get_slice`` handle, so only this rank's
bytes are ever read — and copies this rank's slice into ``target``. The model loader and the shard
writer both go through these loaders: one source of truth for the slicing rules.

With ``p`` TP ranks and ``X`` the input rows:

* Column-parallel        ``Y = X A``, ``A = [A_1 … A_p]`` split by output columns; rank i computes
  ``Y_i = X A_i``. No communication. MergedColumnParallelLinear (gate/up) and QKVParallelLinear
  (q/k/v, split by heads) fuse several such projections of one input into one matmul.
* RowParallelLinear      ``Y = X A``, ``A = [A_1; …; A_p]`` split by input rows and ``X = [X_1 … X_p]``;
  rank i computes ``X_i A_i`` and an all-reduce sums the partials.
* VocabParallelEmbedding rows ``[i·V/p, (i+1)·V/p)`` of the table on rank i; ids outside that range
  look up zeros; an all-reduce assembles the embedding.
* ParallelLMHead         column-parallel over the vocabulary; the logit slices are all-gathered.

(PyTorch stores ``A`` transposed, ``weight = A^T``, so column-parallel slices weight *rows*.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.modeling.parallel.coordinator import Coordinator

WeightSource = Any  # torch.Tensor or safetensors PySafeSlice


def source_shape(source: WeightSource) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def _copy(target: torch.Tensor, piece: torch.Tensor, what: str) -> None:
    if tuple(piece.shape) != tuple(target.shape):
        raise ValueError(f"{what}: checkpoint slice has shape {tuple(piece.shape)}, "
                         f"this rank expects {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(piece.to(dtype=target.dtype))


def _expect_shape(source: WeightSource, expected: tuple[int, ...], what: str) -> None:
    shape = source_shape(source)
    if shape != expected:
        raise ValueError(f"{what}: checkpoint tensor has shape {shape}, expected {expected}")


def replicated_loader(target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
    """Replicated parameters (norms): every rank keeps the whole tensor."""
    _expect_shape(source, tuple(target.shape), "replicated weight")
    _copy(target, source[:], "replicated weight")


class TPLayer(nn.Module):
    def __init__(self, coordinator: Coordinator) -> None:
        super().__init__()
        self.coordinator = coordinator
        self.tp_rank = coordinator.groups.tp_rank
        self.tp_degree = coordinator.groups.tp_degree

    def _split(self, size: int, what: str) -> int:
        """This rank's part of a dimension of ``size`` split evenly across the TP group."""
        if size % self.tp_degree:
            raise ValueError(f"tp_degree={self.tp_degree} does not divide {what}")
        return size // self.tp_degree

    def _param(self, *shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        return param

    def weight_loader(self, target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
        raise NotImplementedError


class MergedColumnParallelLinear(TPLayer):
    """Several column-parallel projections of one input fused into one matmul (gate/up).

    Local weight = ``[W_0 slice; W_1 slice; …]``; ``shard_id`` is the index of the projection.
    """

    def __init__(self, in_features: int, out_sizes: list[int], coordinator: Coordinator, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(coordinator)
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.local_sizes = [self._split(size, f"output size {size}") for size in out_sizes]
        self.weight = self._param(sum(self.local_sizes), in_features, dtype=dtype, device=device)

    def weight_loader(self, target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
        index = int(shard_id)
        _expect_shape(source, (self.out_sizes[index], self.in_features), f"merged weight part {index}")
        local = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        start = self.tp_rank * local
        _copy(target[offset:offset + local], source[start:start + local], f"merged weight part {index}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class QKVParallelLinear(TPLayer):
    """Fused Q, K, V projections split by attention heads.

    Rank i holds query heads ``[i·H/p, (i+1)·H/p)`` and KV heads ``[i·K/p, (i+1)·K/p)``; when
    ``p > K`` each rank holds one KV head, head ``i·K/p`` (replicated on ``p/K`` ranks), so every
    query head still sees its own KV head.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 coordinator: Coordinator, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(coordinator)
        tp = self.tp_degree
        self.heads_local = self._split(num_heads, f"num_attention_heads={num_heads}")
        if (tp <= num_kv_heads and num_kv_heads % tp) or (tp > num_kv_heads and tp % num_kv_heads):
            raise ValueError(f"tp_degree={tp} does not divide num_key_value_heads={num_kv_heads}")
        self.hidden_size, self.head_dim = hidden_size, head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.kv_heads_local = max(1, num_kv_heads // tp)
        self.kv_head_start = (self.tp_rank * num_kv_heads) // tp if tp > num_kv_heads \
            else self.tp_rank * self.kv_heads_local
        self.q_size = self.heads_local * head_dim
        self.kv_size = self.kv_heads_local * head_dim
        self.weight = self._param(self.q_size + 2 * self.kv_size, hidden_size, dtype=dtype, device=device)

    def weight_loader(self, target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
        d = self.head_dim
        if shard_id == "q":
            _expect_shape(source, (self.num_heads * d, self.hidden_size), "q_proj")
            start = self.tp_rank * self.q_size
            _copy(target[:self.q_size], source[start:start + self.q_size], "q_proj")
            return
        if shard_id not in ("k", "v"):
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _expect_shape(source, (self.num_kv_heads * d, self.hidden_size), f"{shard_id}_proj")
        offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
        start = self.kv_head_start * d
        _copy(target[offset:offset + self.kv_size], source[start:start + self.kv_size], f"{shard_id}_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, q_size + 2·kv_size]``: this rank's q, k and v side by side."""
        return F.linear(x, self.weight)


class RowParallelLinear(TPLayer):
    """``weight`` columns ``[tp_rank·in/p, (tp_rank+1)·in/p)``; one all-reduce on the way out."""

    def __init__(self, in_features: int, out_features: int, coordinator: Coordinator, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(coordinator)
        self.in_features, self.out_features = in_features, out_features
        self.in_local = self._split(in_features, f"in_features={in_features}")
        self.weight = self._param(out_features, self.in_local, dtype=dtype, device=device)

    def weight_loader(self, target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
        _expect_shape(source, (self.out_features, self.in_features), "row-parallel weight")
        start = self.tp_rank * self.in_local
        _copy(target, source[:, start:start + self.in_local], "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.coordinator.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(TPLayer):
    """Embedding rows ``[tp_rank·V/p, (tp_rank+1)·V/p)``: masked lookup, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, coordinator: Coordinator, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(coordinator)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_local = self._split(vocab_size, f"vocab_size={vocab_size}")
        self.vocab_start = self.tp_rank * self.vocab_local
        self.weight = self._param(self.vocab_local, hidden_size, dtype=dtype, device=device)

    def weight_loader(self, target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
        _expect_shape(source, (self.vocab_size, self.hidden_size), "embedding")
        _copy(target, source[self.vocab_start:self.vocab_start + self.vocab_local], "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_degree == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.coordinator.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Column-parallel over the vocabulary; the logit slices are all-gathered before sampling."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.coordinator.all_gather(F.linear(hidden, self.weight), dim=-1)
