"""Fused kernels for the decoder layer's element-wise work and decode attention, and their
PyTorch references.

A decode step on CPU is a few large matmuls and, per layer, ~35 small PyTorch ops (RMSNorm alone
is eight); at batch 1 their dispatch is a large share of the step. vLLM's CPU backend answers with
C++ kernels; so do we, for the five pieces of a Llama layer that are not matmuls or attention:

- ``rms_norm(x, w, eps)`` and ``add_rms_norm_(x, residual, w, eps)``: in place, residual becomes
  ``x + residual`` and x its RMSNorm (vLLM's fused_add_rms_norm; no allocation per layer);
- ``rotary_(qkv, cos, sin, heads)``: rotary embedding in place on q and k inside the fused
  projection's output;
- ``silu_and_mul(gate_up) -> silu(gate) * up``;
- ``write_kv(k_cache, v_cache, k, v, slots)``: this step's keys and values into the paged cache;
- ``decode_attention(q, k_cache, v_cache, meta, scale)``: one query per sequence against its
  cached context, read in place through the block table (``cpu_attention.cpp``; the reference
  gathers the blocks into a padded batch and calls SDPA with a padding mask);
- ``prefill_attention``: the same for a prefill or mixed step, the C++ kernel taking every query
  token as a decode row over its own prefix (the reference: SDPA per sequence, causally).

:func:`dense_linear` is the model's dense bfloat16 matmul on CPU (``cpu_gemm.cpp``, AVX512-BF16 or
AVX2 + FMA): batch-invariant,
each output element summed the same way whatever the batch holds, so a sequence's logits do not
depend on what it shares a step with; ``F.linear`` elsewhere.

:func:`greedy_logsumexp` gives a sampler the greedy token and the logsumexp of every row of a
step's logits in one pass each (``cpu_sampling.cpp``).

:class:`TorchOps` is the reference (plain PyTorch, any device); the C++ versions (built with
``torch.utils.cpp_extension`` on first use, cached under ``~/.cache/torch_extensions``, a build
shared by every checkout of the same sources: ``published.py``) round
where the reference rounds, so the two agree to float32 rounding (tests compare them). Their
loops are written to vectorise (``cpu_vec.h``: bfloat16 as bits, a branch-free ``exp``).
:func:`ops_for` picks the C++ kernels for CPU tensors when they build, the reference otherwise;
``SHARDLINE_CPU_KERNELS=0`` forces the reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from services.modeling.attention import AttentionMetadata, gather_decode_attention, paged_attention

log = logging.getLogger(__name__)

# output channels per block of a packed weight (pack_dense's, and the W8A8 kernel's)
PACKED_BLOCK = 16

# The kernels written per instruction set, the dense and quantized matmuls and attention (half the
# compile): what the suite builds a second time for another -march to check the AVX2 paths on an
# AVX-512 machine (vector_kernels).
VECTOR_SOURCES = [Path(__file__).with_name(name) for name in (
    "cpu_bindings.cpp", "cpu_quant.cpp", "cpu_w8a8.cpp", "cpu_w8a8_stream.cpp", "cpu_gemm.cpp", "cpu_gemm_packed.cpp",
    "cpu_gemm_stream.cpp",
    "cpu_amx.cpp", "cpu_attention.cpp", "cpu_attention_rows.cpp", "cpu_amx_attention.cpp")]
SOURCES = VECTOR_SOURCES + [Path(__file__).with_name(name) for name in ("cpu_ops.cpp", "cpu_sampling.cpp",
                                                                        "cpu_layers.cpp")]


class LayerOps(Protocol):
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...
    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> None: ...
    def rotary_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None: ...
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> None: ...
    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float) -> torch.Tensor: ...
    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class TorchOps:
    """The reference: the Hugging Face Llama's arithmetic, op by op."""

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        residual.add_(x)
        x.copy_(TorchOps.rms_norm(residual, w, eps))

    @staticmethod
    def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
        """``qkv`` [tokens, heads_total, d]; cos/sin [tokens, 1, d/2] (or [tokens, d/2])."""
        half = qkv.shape[-1] // 2
        cos, sin = cos.view(-1, 1, half), sin.view(-1, 1, half)
        x = qkv[:, :heads]
        x1, x2 = x[..., :half], x[..., half:]
        x[:] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> None:
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    @staticmethod
    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return gather_decode_attention(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, scale)


def cpu_arch() -> str:
    """The ``-march`` the kernels are built for: this machine's (``native``) unless
    ``SHARDLINE_CPU_ARCH`` names another, e.g. ``x86-64-v3`` (AVX2 + FMA, no AVX-512) to build and
    test on an AVX-512 machine what an AVX2-only one runs."""
    return os.environ.get("SHARDLINE_CPU_ARCH", "native")


@functools.cache
def cpu_kernels():
    """The built C++ module, or None (no compiler, build failure): the reference is used then."""
    try:
        return all_kernels(cpu_arch())
    except Exception as exc:  # noqa: BLE001 - any build problem means: run the reference
        log.warning("CPU kernels unavailable (%s); using the PyTorch reference ops", exc)
        return None


def all_kernels(arch: str):
    """A module of every kernel built for ``-march=arch``; raises on a build failure."""
    return _build(SOURCES, arch)


def vector_kernels(arch: str):
    """A module of the kernels written per instruction set alone (``dense_linear``,
    ``quant_linear``, their ``*_vectorized``, ``amx_ready`` and ``decode_attention``) built for
    ``-march=arch``; raises on a build failure."""
    return _build(VECTOR_SOURCES, arch, variant="vector", defines=("-DSHARDLINE_VECTOR_ONLY",))


def _build(sources: list[Path], arch: str, *, variant: str = "", defines: tuple[str, ...] = ()):
    # deferred: the C++ toolchain wrapper only when the kernels are built
    from torch.utils.cpp_extension import load

    from services.modeling.kernels import published
    from services.modeling.kernels.pch import precompiled_header_flags

    # one build per checkout: ninja rebuilds when the source path changes, so two checkouts
    # sharing ~/.cache/torch_extensions under one name would rebuild each other's module
    tag = hashlib.sha1(f"{sources[0].resolve()}:{arch}{':' + variant if variant else ''}".encode()).hexdigest()[:10]
    # -fopenmp: at::parallel_for is inline OpenMP in torch's headers, serial without it (torch
    # itself links the same libgomp, so the kernels share its thread pool)
    name = f"shardline_cpu_ops_{tag}"
    cflags = ["-O3", f"-march={arch}", "-ffp-contract=off", "-fopenmp", *defines]
    key = published.digest(sources, cflags)
    found = published.find(key) if key else None
    if found is not None:  # the same bytes built before, in any checkout: no ninja, no compile
        try:
            return published.load(found)
        except (ImportError, OSError) as exc:
            log.warning("published CPU kernels %s did not load (%s); building them", found, exc)
    pch = precompiled_header_flags(name, cflags)
    module = load(name=name, sources=[str(p) for p in sources], extra_cflags=[*cflags, *pch],
                  extra_ldflags=["-fopenmp"], verbose=False)
    if key:
        published.publish(key, module.__file__)
    return module


_NONE = torch.empty(0)  # an absent tensor argument of a C++ kernel (no residual, a dense weight's scale)


def stage_weights(layers) -> list[torch.Tensor]:
    """``decoder_layers``' weight list from each layer's ``(input norm, qkv, qkv scale, o, o scale,
    post-attention norm, gate_up, gate_up scale, down, down scale)``; a dense weight's scale is
    None."""
    return [t if t is not None else _NONE for layer in layers for t in layer]


class _CppOps:
    """The C++ kernels behind the :class:`LayerOps` interface (contiguity made explicit)."""

    def __init__(self, module) -> None:
        self._m = module

    def rms_norm(self, x, w, eps):
        return self._m.rms_norm(x.contiguous(), w, eps)

    def add_rms_norm_(self, x, residual, w, eps):
        self._m.add_rms_norm_(x, residual, w, eps)  # in place: no .contiguous() copy to write into

    def rotary_(self, qkv, cos, sin, heads):
        self._m.rotary_(qkv, cos.contiguous(), sin.contiguous(), heads)

    def silu_and_mul(self, gate_up):
        return self._m.silu_and_mul(gate_up.contiguous())

    def write_kv(self, k_cache, v_cache, k, v, slots):
        self._m.write_kv(k_cache, v_cache, k, v, slots)

    def decode_attention(self, q, k_cache, v_cache, meta, scale):
        return self._m.decode_attention(q, k_cache, v_cache, meta.block_tables,
                                        meta.context_lens_tensor(q.device), scale)

    def prefill_attention(self, q, k_cache, v_cache, meta, scale):
        # every query token as a decode row over its own prefix: a token's attention then has the
        # same bits however its prompt was split into chunks and whatever shares the step (SDPA
        # per sequence gave a prompt prefilled in two chunks other bits than in one). Faster than
        # SDPA per sequence, too: a 1024-token SmolLM2 prefill took 0.83-0.92 s instead of 1.07 s.
        return self.decode_attention(q, k_cache, v_cache, meta.per_token, scale)



class _CppStageOps(_CppOps):
    """The same, with the stage kernel: a stage's layers in one C++ call."""

    def decoder_layers(self, h, residual, weights, k_caches, v_caches, rope, meta, eps, scale, heads, kv_heads,
                       head_dim, chunks=0):
        """A stage's layers in one call (``cpu_layers.cpp``): the same kernels, in the order
        ``LlamaDecoderLayer.forward`` calls them, for a rank with whole layers (TP = 1).
        ``weights``: ten per layer (see the C++ file); ``chunks``: the row-parallel layers'
        layout-invariant k-chunks (0: none); returns ``(h, residual)``."""
        rows = meta if meta.is_decode else meta.per_token
        h, residual = self._m.decoder_layers(h, residual if residual is not None else _NONE, weights, k_caches,
                                             v_caches, rope[0], rope[1], meta.slot_mapping, rows.block_tables,
                                             rows.context_lens_tensor(h.device), eps, scale, heads, kv_heads,
                                             head_dim, chunks)
        return h, residual


def kernels_enabled() -> bool:
    return os.environ.get("SHARDLINE_CPU_KERNELS", "1") not in ("0", "false", "no")


def _cpu_module(device: torch.device | str | None):
    """The built C++ module when ``device`` is the CPU and the kernels are enabled, else None."""
    if torch.device(device or "cpu").type == "cpu" and kernels_enabled():
        return cpu_kernels()
    return None


def kernels_for(t: torch.Tensor):
    """:func:`_cpu_module` for a tensor's device, in the fewest steps: the kernels of a decode
    step ask once per layer each, and the general checks had cost a matmul ~4 µs a call (121
    calls a SmolLM2 token)."""
    return cpu_kernels() if t.is_cpu and kernels_enabled() else None


def ops_for(device: torch.device | str | None) -> LayerOps:
    """The fused kernels for CPU when enabled and built; the PyTorch reference otherwise."""
    module = _cpu_module(device)
    if module is None:
        return TorchOps()
    # a build without the stage kernel (a test's mix of another -march's matmuls): layer by layer
    return _CppStageOps(module) if hasattr(module, "decoder_layers") else _CppOps(module)


def greedy_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` [n, vocab] (any float dtype): the greedy token (first maximum, as
    ``argmax``) and ``logsumexp`` in float32. The C++ kernel on CPU, PyTorch elsewhere."""
    module = kernels_for(logits) if logits.stride(-1) == 1 else None
    if module is not None:
        ids, lse = module.greedy_logsumexp(logits)
        return ids, lse
    values = logits.float()
    return values.max(dim=-1).indices, torch.logsumexp(values, dim=-1)


def mask_tokens_(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """In place on float32 ``logits`` [n, vocab]: token t of row r to -inf unless bit t of
    ``masks`` [n, bytes] (uint8, LSB first) row r is set. The C++ kernel on CPU, PyTorch elsewhere."""
    module = kernels_for(logits) if logits.stride(-1) == 1 and logits.dtype == torch.float32 else None
    if module is not None and masks.device.type == "cpu":
        module.mask_tokens_(logits, masks.contiguous())
        return
    bits = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=masks.device)
    allowed = ((masks[:, :, None] & bits) != 0).flatten(1).to(logits.device)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], dim=1)
    logits.masked_fill_(~allowed[:, :vocab], float("-inf"))


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)``: ``x`` [..., K], ``w`` [N, K] → [..., N]. bfloat16 on CPU (kernels
    enabled and built with AVX512-BF16 or AVX2 + FMA, ``w`` contiguous): the C++ kernel,
    batch-invariant (row m of the result has the same bits whatever the other rows are, and
    whatever M and the thread count), float32 sums rounded once. Anything else (float32, other
    devices, neither instruction set): ``F.linear``."""
    module = _dense_module(x, w)
    if module is None:
        return F.linear(x, w)
    if x.dim() == 2:  # the model's activations: no reshape and view (a microsecond each)
        return module.dense_linear(x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    return module.dense_linear(x.reshape(-1, k), w).view(*lead, out_features(w))


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """bfloat16 weight [N, K] as :func:`dense_linear` takes it best here: packed for the kernel
    (``[N/16, K/2, 16, 2]``: 16 channels' k-pairs side by side, ``cpu_gemm_packed.h``) on a
    machine without AMX (AVX512-BF16, or AVX2 + FMA), N a multiple of 16 and K even; ``w`` itself
    otherwise (AMX tiles, other dtypes and devices, kernels off). Either way the product's bits do not
    depend on the batch."""
    module = _dense_module(w, w) if w.dim() == 2 else None
    return module.dense_pack(w) if module is not None else w


def out_features(w: torch.Tensor) -> int:
    """N of a dense weight [N, K], packed or not."""
    return w.shape[0] * PACKED_BLOCK if w.dim() == 4 else w.shape[0]


def packed_block_rows(packed: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``rows`` [T] of a weight [N, k] packed in blocks of 16 channels with each channel's
    consecutive k side by side (``[N/16, …, 16, g]``: :func:`pack_dense`'s g = 2, int8's W8A8
    g = 4), as [T, k] in the packed dtype (a zero-padded K cut back to k)."""
    block, lane = rows // PACKED_BLOCK, rows % PACKED_BLOCK
    return packed[block, :, lane, :].reshape(rows.shape[0], -1)[:, :k]


def _dense_module(x: torch.Tensor, w: torch.Tensor):
    """The module whose bfloat16 kernels take ``x`` times ``w``ᵀ here (both bfloat16 on the CPU,
    ``w`` contiguous, the kernels enabled and vectorized); None otherwise."""
    if x.dtype is torch.bfloat16 and w.dtype is torch.bfloat16 and w.is_cpu and w.is_contiguous():
        module = kernels_for(x)
        if module is not None and _gemm_vectorized(module):
            return module
    return None


def dense_linear_chunks(x: torch.Tensor, w: torch.Tensor, chunks: int, *, sum: bool) -> torch.Tensor | None:
    """The C++ kernel's fixed-chunk products of a row-parallel layer (``dense_linear_chunks`` in
    ``cpu_gemm.cpp``): ``w`` [N, K] in ``chunks`` equal k-ranges, read in place; summed to
    ``x``'s shape with ``sum``, else ``[chunks, ..., N]``. None where :func:`dense_linear` would
    not run the kernel (the caller takes the chunks one by one)."""
    module = _dense_module(x, w)
    if module is None:
        return None
    lead, k = x.shape[:-1], x.shape[-1]
    out = module.dense_linear_chunks(x.reshape(-1, k), w, chunks, sum)
    n = out_features(w)
    return out.view(*lead, n) if sum else out.view(chunks, *lead, n)


def dense_linear_vectorized() -> bool:
    """Whether :func:`dense_linear` runs the C++ kernel on CPU here (built with AVX512-BF16 or
    AVX2 + FMA, enabled)."""
    module = _cpu_module("cpu")
    return module is not None and _gemm_vectorized(module)


@functools.cache
def _gemm_vectorized(module) -> bool:
    """The built module's answer, asked once (each linear of every step would ask otherwise)."""
    return bool(module.dense_linear_vectorized())
