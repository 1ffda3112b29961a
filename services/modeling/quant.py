"""Weight quantization: the int8 and fp8 schemes, their exact sharding, and the quantized matmul.

Both schemes' weights are symmetric and per output channel. For a linear weight ``W``
``[N, K]`` (PyTorch's layout: one row per output channel ``n``):

* ``scale[n] = max_k |W[n, k]| / Q`` in float32 (a row of zeros gets scale 1, so it stays zeros);
* ``q[n, k] = clamp(W[n, k] / scale[n], -Q, Q)``, then
  - **int8**: rounded to the nearest integer (ties to even) and stored as ``int8``, ``Q = 127``
    (−128 is never used, so the range is symmetric);
  - **fp8**: cast to ``float8_e4m3fn`` (round to nearest even), ``Q = 448``, e4m3's largest finite
    value: the clamp keeps a value that rounds up past 448 from becoming NaN (e4m3fn has no inf);
* the layer computes ``y[m, n] = scale[n] · Σ_k x̂[m, k] · q[n, k]``, where ``x̂`` is
  - **int8** (W8A8): the activations quantized at each call to int8 with one scale per 32
    consecutive values of a row (``d[m, g] = max_{k∈g} |x[m, k]| / 127``,
    ``xq = round_half_even(x / d)``; llama.cpp's Q8_0 grouping), ``x̂ = d · xq``: integer dot
    products per group, the groups added in float32 (:data:`ACTIVATION_GROUP`);
  - **fp8** (W8A16): the activations themselves, in their dtype (bfloat16, or float32).

Round trip: ``|W − scale·q| ≤ scale/2 = max|W[n]|/254`` per element for int8; for fp8 the error
is relative, ``≤ 2⁻⁴·|W|`` (3 mantissa bits) for values in e4m3's normal range and
``≤ 2⁻¹⁰·scale`` below it.

Scales are float32 so that ``W / scale`` is one correctly rounded float32 division of the
checkpoint value (bfloat16 or float32, both exact in float32).

**Sharding stays exact.** ``q[n, k]`` depends only on ``W[n, k]`` and ``scale[n]``, and ``scale[n]``
only on row ``n``. A column-parallel layer (rows split across TP ranks) keeps its rows' scales; a
row-parallel layer (split along K) keeps every row's scale, computed from the whole unsharded row.
So quantizing the full weight and then slicing gives bit-identical values to quantizing on a rank
from its slice: a TP=3 plan and a TP=1 plan hold the same numbers.

**The matmul** (:func:`quant_linear`) never materialises a dequantized weight. int8 on CPU: the
C++ kernel (``kernels/cpu_w8a8.cpp``) takes the weight repacked once, at the first call after
loading (:func:`pack_int8`: the layer's parameter then holds the packed bytes, still one byte a
weight), into the layout of the integer dot-product instructions (AVX512-VNNI ``vpdpbusd``, AVX2
``vpmaddubsw``); its group sums are exact, so every path gives the same bits. int8 costs
+0.36 % perplexity on the golden set against bfloat16 (activations per token, simulated: +3.3 %;
``docs/numerics.md``). fp8 on CPU: the C++ kernel (``kernels/cpu_quant.cpp``) reads
each weight byte once and converts it in registers (at 4+ rows, 16 weight rows at a time into a
few-KB bfloat16 scratch that stays in cache), so a decode step reads one byte per weight instead
of two. Measured on the project's CPU against
the bfloat16 ``F.linear`` and torch's own int8 and fp8 kernels (``bench/results/quant-kernels.md``).
Elsewhere (no kernel build, ``SHARDLINE_CPU_KERNELS=0``, CUDA) torch's ops run. On a CUDA device
of compute capability 8.9+ with bfloat16 activations fp8 takes ``torch._scaled_mm`` — the e4m3
tensor cores, so the activations are quantized to e4m3 per token there (W8A8), with row-wise
scales, or (a shape cuBLAS refuses row-wise) unit scales and both scales applied to the float32
product. int8 without the C++ kernel (CUDA; a CPU with ``SHARDLINE_CPU_KERNELS=0``) quantizes the
activations the same way and multiplies their dequantized values ``d · xq`` in the activation
dtype (the same scheme; the products rounded as that dtype's). On CUDA it converts the weight to
the activation dtype block by block (torch's ``_weight_int8pack_mm`` CUDA kernel is a plain loop,
far slower); on the CPU ``torch._weight_int8pack_mm`` for int8 (with bfloat16 scales when the
activations are bfloat16: torch's requirement); otherwise, for fp8 and for int8 weights whose K
torch's kernel cannot take, a blocked dequantize-and-matmul that converts
:data:`DEQUANT_BLOCK_ROWS` rows at a time (never the whole weight; correct, but slow on CPU,
where torch's float8 conversion is slow).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.modeling.kernels import kernels_for, packed_block_rows

log = logging.getLogger(__name__)


class QuantizationError(ValueError):
    """A weight or scale that does not fit the scheme (dtype, shape)."""


@dataclass(frozen=True)
class QuantScheme:
    """One weight quantization scheme: what a quantized linear stores and how it was derived."""

    name: str  # the serving dtype's canonical name (services.common.dtypes): "int8" or "fp8"
    weight_dtype: torch.dtype
    qmax: float  # the largest magnitude a quantized value takes
    scale_dtype: torch.dtype = torch.float32
    granularity: str = "per-output-channel"

    @property
    def weight_bytes(self) -> int:
        return torch.empty(0, dtype=self.weight_dtype).element_size()


INT8 = QuantScheme("int8", torch.int8, 127.0)
ACTIVATION_GROUP = 32  # int8: activation values per scale (W8A8); the C++ kernel's kGroup
FP8 = QuantScheme("fp8", torch.float8_e4m3fn, 448.0)
SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (INT8, FP8)}


def scheme_record(scheme: QuantScheme, *, lm_head: bool) -> dict[str, object]:
    """What a quantized checkpoint says of its scheme (manifest and every shard header), so that
    a loader can refuse data quantized another way: dtype, granularity, scales, lm_head."""
    return {"scheme": scheme.name, "weight_dtype": str(scheme.weight_dtype).removeprefix("torch."),
            "qmax": scheme.qmax, "granularity": scheme.granularity, "symmetric": True,
            "scale_dtype": str(scheme.scale_dtype).removeprefix("torch."),
            "quantized": "decoder linear weights" + (" and lm_head" if lm_head else ""), "lm_head": lm_head}


def scheme_for(dtype_name: str) -> QuantScheme | None:
    """The scheme of a canonical serving dtype name; None for a dense dtype."""
    return SCHEMES.get(dtype_name)


def channel_scales(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``max_k |W[n, k]| / Q`` per row of ``weight`` [N, K] (float32 [N]); all-zero rows get 1."""
    amax = weight.float().abs().amax(dim=1)
    return torch.where(amax > 0, amax / scheme.qmax, torch.ones_like(amax))


def quantize_with_scales(weight: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``weight`` [N, K] (any columns of the rows ``scale`` [N] was computed from) → quantized [N, K]."""
    if scale.shape != (weight.shape[0],):
        raise QuantizationError(f"scales have shape {tuple(scale.shape)}, weight has {weight.shape[0]} rows")
    scaled = (weight.float() / scale.float().unsqueeze(1)).clamp_(-scheme.qmax, scheme.qmax)
    if scheme.weight_dtype == torch.int8:
        scaled = scaled.round_()
    return scaled.to(scheme.weight_dtype)


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole weight [N, K] → (quantized [N, K], float32 scales [N])."""
    scale = channel_scales(weight, scheme)
    return quantize_with_scales(weight, scale, scheme), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale[n] · q[n, k]`` — for tests and references; the model never calls it on a whole weight."""
    return (q.float() * scale.float().unsqueeze(1)).to(dtype)


def shard_column_parallel(q: torch.Tensor, scale: torch.Tensor, start: int, stop: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Output rows ``[start, stop)``: the rows and their scales."""
    return q[start:stop], scale[start:stop]


def shard_row_parallel(q: torch.Tensor, scale: torch.Tensor, start: int, stop: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Input columns ``[start, stop)``: every row's columns, and every row's (whole-row) scale."""
    return q[:, start:stop], scale


def weight_nbytes(q: torch.Tensor, scale: torch.Tensor) -> int:
    return q.numel() * q.element_size() + scale.numel() * scale.element_size()


# fp8 rows dequantized per step of the portable fallback (a few hundred KB of bfloat16 at most)
DEQUANT_BLOCK_ROWS = 256


def quant_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``y = x̂ · (scale ⊙ q)ᵀ``: ``x`` [..., K] (bfloat16 or float32), ``q`` [N, K] int8 or
    float8_e4m3fn, or int8 packed by :func:`pack_int8`, ``scale`` float32 [N] → ``y`` [..., N] in
    ``x``'s dtype (``x̂``: see the top).

    The C++ kernels wherever they run (CPU, built, enabled): W8A8 1.5-3.3x the bfloat16 kernel
    from 1 to 256 rows, fp8 the only kernel on CPU that is not tens of times slower than bfloat16
    (``bench/results/quant-kernels.md``)."""
    module = kernels_for(x)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = module.quant_linear(rows, q, scale) if module is not None else quant_linear_torch(rows, q, scale)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], scale.shape[0])


def quant_linear_chunks(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, chunks: int, *,
                        sum: bool) -> torch.Tensor | None:
    """The layout-invariant numerics' row-parallel product of a quantized weight in one C++ call
    (``quant_linear_chunks``): ``x``'s K in ``chunks`` fixed chunks, ``q`` as
    ``RowParallelLinear.stage_weight`` holds it (int8 packed whole by :func:`pack_int8`, or each
    chunk's weight ``[chunks, N, W]``, int8 packed per chunk or fp8), each chunk's product the bits
    of :func:`quant_linear` on that chunk alone; summed in float32 in chunk order to ``x``'s shape
    with ``sum``, else ``[chunks, ..., N]``. None where the kernels do not run (the caller takes
    the chunks one by one)."""
    module = kernels_for(x)
    if module is None:
        return None
    k = x.shape[-1]
    out = module.quant_linear_chunks(x.reshape(-1, k), q, scale, chunks, sum)
    n = scale.shape[0]
    return out.view(*x.shape[:-1], n) if sum else out.view(chunks, *x.shape[:-1], n)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weight [N, K] as :func:`quant_linear` takes it best on its device: the C++ W8A8
    kernel's layout (uint8 ``[⌈N/16⌉, ⌈K/32⌉·8, 16, 4]``: 16 channels' 4 consecutive bytes side by
    side, each ``q + 128``, zero-padded) where that kernel runs, else ``q`` itself."""
    module = kernels_for(q)
    return module.w8a8_pack(q) if module is not None and q.dtype == torch.int8 else q


def packed_rows(packed: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``rows`` [T] of the int8 weight [N, k] that :func:`pack_int8` packed: int8 [T, k]."""
    return (packed_block_rows(packed, rows, k).to(torch.int16) - 128).to(torch.int8)  # bytes are q + 128


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] → (int8 values as float32 [M, Kp], scales float32 [M, Kp / 32]): the int8
    scheme's activations, K padded with zeros to a multiple of :data:`ACTIVATION_GROUP`."""
    m, k = x.shape
    padded = F.pad(x.float(), (0, -k % ACTIVATION_GROUP)).view(m, -1, ACTIVATION_GROUP)
    d = padded.abs().amax(dim=2) / INT8.qmax
    xq = torch.where(d.unsqueeze(2) > 0, padded / d.unsqueeze(2), torch.zeros_like(padded))
    return xq.round_().clamp_(-INT8.qmax, INT8.qmax).view(m, -1), d


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """``d · xq`` [M, K] in ``x``'s dtype: the values the int8 scheme multiplies."""
    xq, d = quantize_activations(x)
    return (xq.view(*d.shape, ACTIVATION_GROUP) * d.unsqueeze(2)).view(x.shape[0], -1)[:, :x.shape[1]].to(x.dtype)


# torch._weight_int8pack_mm on CPU (torch 2.13) needs K % 16 == 0: other K give wrong sums or
# crash; such weights take the blocked path
INT8PACK_K_MULTIPLE = 16


def quant_linear_torch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same product from torch's own ops (any device): x [M, K] → [M, N]."""
    if q.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise QuantizationError(f"quantized weight must be int8 or float8_e4m3fn, got {q.dtype}")
    if q.dtype == torch.float8_e4m3fn and x.is_cuda and _cuda_fp8_ok(x, q):
        return _scaled_mm_fp8(x, q, scale)
    if q.dtype == torch.int8:
        x = dequantized_activations(x)
    if x.is_cuda:
        return _blocked(x, q, scale, block_rows=q.shape[0])
    if q.dtype == torch.int8 and q.shape[1] % INT8PACK_K_MULTIPLE == 0 and _has_int8pack(x.device.type):
        # torch wants the scales in x's dtype: bfloat16 scales round them (relative 2^-9)
        return torch._weight_int8pack_mm(x, q, scale.to(x.dtype))
    return _blocked(x, q, scale)


@functools.cache
def _has_int8pack(device_type: str) -> bool:
    """Whether this build of torch has ``_weight_int8pack_mm`` for the device (tried once)."""
    try:
        x = torch.ones(1, 16, dtype=torch.bfloat16, device=device_type)
        torch._weight_int8pack_mm(x, torch.ones(16, 16, dtype=torch.int8, device=device_type),
                                  torch.ones(16, dtype=torch.bfloat16, device=device_type))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _blocked(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block_rows: int = DEQUANT_BLOCK_ROWS
             ) -> torch.Tensor:
    out = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype, device=x.device)
    for start in range(0, q.shape[0], block_rows):
        stop = min(start + block_rows, q.shape[0])
        # int8 and e4m3 values are exact in bfloat16; the scale multiplies the output
        out[:, start:stop] = F.linear(x, q[start:stop].to(x.dtype)).float() * scale[start:stop]
    return out


def _cuda_fp8_ok(x: torch.Tensor, q: torch.Tensor) -> bool:
    """``torch._scaled_mm`` with row-wise scales: sm89+ (e4m3 tensor cores), bfloat16 output, and
    K and N multiples of 16."""
    return (torch.cuda.get_device_capability(x.device) >= (8, 9) and x.dtype == torch.bfloat16
            and q.shape[1] % 16 == 0 and q.shape[0] % 16 == 0)


def _scaled_mm_fp8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """On GPU the e4m3 tensor cores multiply e4m3 by e4m3, so the activations are quantized too,
    per token (row): ``x ≈ x_scale[m] · x8[m, k]`` with ``x_scale = max|x[m]| / 448`` (W8A8).

    Row-wise scales where cuBLAS takes them; a (K, N) it refuses (some large K at small M) is
    remembered, and multiplies with unit scales into float32, both scales applied after."""
    xf = x.float()
    x_scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8.qmax
    x8 = (xf / x_scale).clamp_(-FP8.qmax, FP8.qmax).to(torch.float8_e4m3fn)
    w_scale = scale.view(1, -1).float()
    shape = (q.shape[1], q.shape[0], x.device.index)
    if shape not in _ROWWISE_REFUSED:
        try:
            return torch._scaled_mm(x8, q.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
        except RuntimeError as exc:  # met in an eager step before any capture: never inside a CUDA graph
            _ROWWISE_REFUSED.add(shape)
            log.warning("fp8 matmul K=%d N=%d: row-wise scales refused (%s); unit scales, applied after",
                        q.shape[1], q.shape[0], str(exc).splitlines()[0])
    one = x_scale.new_ones(())
    product = torch._scaled_mm(x8, q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (product * x_scale * w_scale).to(x.dtype)


_ROWWISE_REFUSED: set[tuple[int, int, int | None]] = set()  # (K, N, device) cuBLAS refused row-wise
