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

Dense weights multiply through :func:`~services.modeling.kernels.dense_linear` (``F.linear``, or in
bfloat16 on CPU a batch-invariant C++ kernel: a sequence's rows get the same bits in any batch).

Quantized (``quant=`` a :class:`~services.modeling.quant.QuantScheme`): a linear layer holds
``weight`` in the scheme's dtype and ``weight_scale`` (float32, one per local output row), and
multiplies through :func:`~services.modeling.quant.quant_linear`. The loaders quantize on the way
in, from the full-precision checkpoint tensor: each rank's scales come from its rows — whole rows,
also in a row-parallel layer, which reads the full rows to get them — so every rank holds exactly
the values a TP=1 model holds. Both parameters share the layer's loader; a 1-D target is the scale.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.modeling.compressed_tensors import QuantizedPiece
from services.modeling.kernels import dense_linear, dense_linear_chunks, kernels_for, pack_dense, packed_block_rows
from services.modeling.parallel.coordinator import Coordinator
from services.modeling.quant import (
    ACTIVATION_GROUP,
    QuantScheme,
    channel_scales,
    pack_int8,
    packed_rows,
    quant_linear,
    quant_linear_chunks,
    quantize_with_scales,
)

WeightSource = Any  # torch.Tensor, safetensors PySafeSlice, or compressed_tensors.CompressedWeight


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


class LinearBase(TPLayer):
    """``weight`` [out_local, in_local], dense or quantized (then with ``weight_scale`` [out_local])."""

    def _weights(self, out_local: int, in_local: int, *, dtype: torch.dtype, device: torch.device | str | None,
                 quant: QuantScheme | None) -> None:
        self.quant = quant
        self._repacked = False  # kernel_weight has given the weight the kernel's layout (or kept it)
        self.weight = self._param(out_local, in_local, dtype=quant.weight_dtype if quant else dtype, device=device)
        self.weight_scale = self._param(out_local, dtype=quant.scale_dtype, device=device) if quant else None

    def _place(self, target: torch.Tensor, piece: torch.Tensor, what: str, *,
               rows: torch.Tensor | None = None) -> None:
        """Copy checkpoint slice ``piece`` into ``target``; quantized, the weight or (1-D target)
        the scales, from the whole rows ``rows`` (``piece`` itself when it has them all).

        A piece of an already quantized checkpoint (compressed-tensors) gives its own codes and
        scales to a plan of its scheme, its values to a dense plan."""
        if isinstance(piece, QuantizedPiece):
            self._place_quantized(target, piece, what, rows=rows)
            return
        if self.quant is None:
            _copy(target, piece, what)
            return
        scale = channel_scales(piece if rows is None else rows, self.quant)
        if target.dim() == 1:
            _copy(target, scale, f"{what} scales")
        else:
            _copy(target, quantize_with_scales(piece, scale, self.quant), what)

    def _place_quantized(self, target: torch.Tensor, piece: QuantizedPiece, what: str, *,
                         rows: QuantizedPiece | None) -> None:
        if self.quant is None:
            _copy(target, piece.dequantized(), what)
        elif piece.scheme is not self.quant:
            raise ValueError(f"{what}: the checkpoint holds {piece.scheme.name} codes, this plan quantizes to "
                             f"{self.quant.name}: serve it as {piece.scheme.name} or dense")
        elif target.dim() == 1:
            _copy(target, (piece if rows is None else rows).scale, f"{what} scales")
        else:
            _copy(target, piece.codes, what)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return dense_linear(x, self.kernel_weight())
        return quant_linear(x, self.kernel_weight(), self.weight_scale)

    def kernel_weight(self) -> torch.Tensor:
        """The weight as the matmul kernel takes it, repacked at the first call after loading
        where the kernel has a layout of its own: an int8 one for the integer dot products
        (:func:`~services.modeling.quant.pack_int8`), a bfloat16 one for the vector kernel
        (:func:`~services.modeling.kernels.pack_dense`). In place: the parameter then holds the
        packed tensor (another shape, so that nothing reads it as [N, K] unawares), one copy; a
        tied embedding reads its rows from it. Decided once: every later call (each matmul of a
        decode step) only returns the weight."""
        if self._repacked:
            return self.weight
        self._repacked = True
        w = self.weight.data
        if w.dtype == torch.int8:
            packed = pack_int8(w)
        elif self.quant is None and self._packable():
            packed = pack_dense(w)
        else:
            return self.weight
        if packed is not w:
            self.weight.data = packed
        return self.weight

    def _packable(self) -> bool:
        """Whether a dense weight may take the packed layout (a row-parallel layer's chunks may
        forbid it)."""
        return True


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of one input fused into one matmul (gate/up).

    Local weight = ``[W_0 slice; W_1 slice; …]``; ``shard_id`` is the index of the projection.
    """

    def __init__(self, in_features: int, out_sizes: list[int], coordinator: Coordinator, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 quant: QuantScheme | None = None) -> None:
        super().__init__(coordinator)
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.local_sizes = [self._split(size, f"output size {size}") for size in out_sizes]
        self._weights(sum(self.local_sizes), in_features, dtype=dtype, device=device, quant=quant)

    def weight_loader(self, target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
        index = int(shard_id)
        _expect_shape(source, (self.out_sizes[index], self.in_features), f"merged weight part {index}")
        local = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        start = self.tp_rank * local
        self._place(target[offset:offset + local], source[start:start + local], f"merged weight part {index}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)


class QKVParallelLinear(LinearBase):
    """Fused Q, K, V projections split by attention heads.

    Rank i holds query heads ``[i·H/p, (i+1)·H/p)`` and KV heads ``[i·K/p, (i+1)·K/p)``; when
    ``p > K`` each rank holds one KV head, head ``i·K/p`` (replicated on ``p/K`` ranks), so every
    query head still sees its own KV head.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 coordinator: Coordinator, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, quant: QuantScheme | None = None) -> None:
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
        self._weights(self.q_size + 2 * self.kv_size, hidden_size, dtype=dtype, device=device, quant=quant)

    def weight_loader(self, target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
        d = self.head_dim
        if shard_id == "q":
            _expect_shape(source, (self.num_heads * d, self.hidden_size), "q_proj")
            start = self.tp_rank * self.q_size
            self._place(target[:self.q_size], source[start:start + self.q_size], "q_proj")
            return
        if shard_id not in ("k", "v"):
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _expect_shape(source, (self.num_kv_heads * d, self.hidden_size), f"{shard_id}_proj")
        offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
        start = self.kv_head_start * d
        self._place(target[offset:offset + self.kv_size], source[start:start + self.kv_size], f"{shard_id}_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, q_size + 2·kv_size]``: this rank's q, k and v side by side."""
        return self._matmul(x)


class RowParallelLinear(LinearBase):
    """``weight`` columns ``[tp_rank·in/p, (tp_rank+1)·in/p)``; one all-reduce on the way out.

    Quantized, every rank keeps every row's scale, from the whole unsharded row.

    With ``invariant_chunks`` C (the layout-invariant numerics), the input dimension is cut into
    C fixed chunks, each rank's slice a union of C/p of them: each chunk's product is computed on
    its own (the same kernel on the same shapes at every TP degree), the chunks' partials are
    all-gathered in chunk order and summed in float32 in that one order. So the output has the
    same bits whichever ranks held which chunks, TP1 included, where the backend's all-reduce
    would sum each rank's whole slice in its own ring order."""

    def __init__(self, in_features: int, out_features: int, coordinator: Coordinator, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 quant: QuantScheme | None = None, invariant_chunks: int = 0) -> None:
        super().__init__(coordinator)
        self.in_features, self.out_features = in_features, out_features
        self.in_local = self._split(in_features, f"in_features={in_features}")
        if invariant_chunks and (invariant_chunks % self.tp_degree or in_features % invariant_chunks):
            raise ValueError(f"{invariant_chunks} layout-invariant chunks split neither tp_degree={self.tp_degree} "
                             f"nor in_features={in_features} evenly")
        self.invariant_chunks = invariant_chunks
        # stage_weight's quantized weight in the layout-invariant numerics (int8 packed whole, or the
        # chunks), made at its first call after loading
        self._chunk_weights: torch.Tensor | None = None
        self._weights(out_features, self.in_local, dtype=dtype, device=device, quant=quant)

    def weight_loader(self, target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
        _expect_shape(source, (self.out_features, self.in_features), "row-parallel weight")
        start = self.tp_rank * self.in_local
        if self.quant is None:
            self._place(target, source[:, start:start + self.in_local], "row-parallel weight")
            return
        rows = source[:]  # the scales need whole rows: this rank reads all of them
        self._place(target, rows[:, start:start + self.in_local], "row-parallel weight", rows=rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant_chunks:
            return self._layout_invariant(x)
        return self.coordinator.all_reduce(self._matmul(x))

    def _layout_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring: this rank's chunks' products, every rank's in chunk order,
        one fixed float32 sum."""
        count = self.invariant_chunks // self.tp_degree  # this rank's chunks
        local = self.tp_degree == 1
        # the C++ kernel in one call, where it runs (at TP1 it sums the products too)
        if self.quant is None:
            done = dense_linear_chunks(x, self.kernel_weight(), count, sum=local)
        else:
            done = quant_linear_chunks(x, self.stage_weight(), self.weight_scale, count, sum=local)
        if done is not None and local:
            return done
        if done is None:  # no C++ kernel here (CUDA, SHARDLINE_CPU_KERNELS=0): torch's ops
            done = self._chunk_products(x, count)
        if not local:
            done = self.coordinator.all_gather(done, dim=0)  # rank order = chunk order
        out = done[0].float()  # the products in chunk order, in float32 (widening is exact)
        for partial in done[1:]:
            out += partial
        return out.to(x.dtype)

    def _chunk_products(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """Each chunk's product alone, ``[count, ..., out]``: x's and the weight's k-range [j·W,
        (j+1)·W) for chunk j; a dense weight's in one batched matmul (as the C++ fallback does)."""
        width = self.in_local // count
        rows = x.reshape(-1, self.in_local)
        if self.quant is None:
            parts = torch.bmm(rows.reshape(-1, count, width).transpose(0, 1),
                              self.weight.view(self.out_features, count, width).permute(1, 2, 0))
        else:
            parts = torch.stack([quant_linear(rows[:, j * width:(j + 1) * width], self.stage_weight()[j],
                                              self.weight_scale) for j in range(count)])
        return parts.view(count, *x.shape[:-1], self.out_features)

    def _packable(self) -> bool:
        """A packed dense weight is read in whole k-pairs: each layout-invariant chunk must hold
        an even number of columns."""
        return not self.invariant_chunks or (self.in_local // (self.invariant_chunks // self.tp_degree)) % 2 == 0

    def _whole_int8(self) -> bool:
        """int8 in the layout-invariant numerics where the W8A8 kernel sums the chunks in one call
        on the weight packed whole (:func:`quant_linear_chunks`): its kernel runs here and each
        chunk is whole activation groups."""
        width = self.in_local // (self.invariant_chunks // self.tp_degree)
        return (self.weight.dtype in (torch.int8, torch.uint8) and kernels_for(self.weight) is not None
                and width % ACTIVATION_GROUP == 0)

    def stage_weight(self) -> torch.Tensor:
        """The weight as the fused decoder-layer call takes it: the weight itself (int8 packed
        whole where :meth:`_whole_int8`), or in the layout-invariant numerics another quantized one
        as [chunks, out, W], each chunk's rows contiguous (the quantized kernel reads a weight as
        one block), made at the first call after loading."""
        if not (self.invariant_chunks and self.quant is not None):
            return self.kernel_weight()
        if self._chunk_weights is None:  # decided once, at the first call after loading
            if self._whole_int8():
                self._chunk_weights = self.kernel_weight()
            else:
                count = self.invariant_chunks // self.tp_degree
                chunks = self.weight.view(self.out_features, count, self.in_local // count).transpose(0, 1).contiguous()
                self._chunk_weights = torch.stack([pack_int8(chunk) for chunk in chunks])  # int8: each on its own
        return self._chunk_weights


class VocabParallelEmbedding(LinearBase):
    """Embedding rows ``[tp_rank·V/p, (tp_rank+1)·V/p)``: masked lookup, then all-reduce.

    Quantized (only as the table a tied, quantized lm_head shares), a lookup dequantizes just the
    rows it reads: ``out[t] = scale[id_t] · q[id_t]`` in ``dtype``, the activation dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, coordinator: Coordinator, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 quant: QuantScheme | None = None) -> None:
        super().__init__(coordinator)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_local = self._split(vocab_size, f"vocab_size={vocab_size}")
        self.vocab_start = self.tp_rank * self.vocab_local
        self.activation_dtype = dtype
        self._weights(self.vocab_local, hidden_size, dtype=dtype, device=device, quant=quant)

    def weight_loader(self, target: torch.Tensor, source: WeightSource, shard_id: Any = None) -> None:
        _expect_shape(source, (self.vocab_size, self.hidden_size), "embedding")
        self._place(target, source[self.vocab_start:self.vocab_start + self.vocab_local], "embedding")

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.quant is None:
            if self.weight.dim() == 2:
                return F.embedding(ids, self.weight)
            # packed by a tied lm_head's first matmul
            return packed_block_rows(self.weight, flat, self.hidden_size).view(*ids.shape, self.hidden_size)
        if self.weight.dtype == torch.uint8:  # int8, packed by a tied lm_head's first matmul
            rows = packed_rows(self.weight, flat, self.hidden_size)
        else:  # gather the rows as bytes (index_select has no float8 kernel), then dequantize them
            rows = self.weight.view(torch.uint8).index_select(0, flat).view(self.weight.dtype)
        out = rows.float() * self.weight_scale.index_select(0, flat).unsqueeze(1)
        return out.to(self.activation_dtype).view(*ids.shape, self.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_degree == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.coordinator.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Column-parallel over the vocabulary; the logit slices are all-gathered before sampling."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.coordinator.all_gather(self._matmul(hidden), dim=-1)
