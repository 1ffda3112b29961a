"""The int8/fp8 weight schemes (services/modeling/quant.py) and the quantized matmul kernels.

Round trips are checked against the bounds the module states; the kernels against a float64
product of the dequantized weight, so the only differences left are accumulation order and, for
bfloat16 activations, the output's rounding."""

from __future__ import annotations

import pytest
import torch

from services.modeling import quant
from services.modeling.kernels import cpu_arch, cpu_kernels
from services.modeling.quant import (
    FP8,
    INT8,
    channel_scales,
    dequantize,
    dequantized_activations,
    quant_linear,
    quant_linear_torch,
    quantize,
)

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


def weights(n: int = 64, k: int = 96, seed: int = 0) -> torch.Tensor:
    """Gaussian rows of different magnitudes, one outlier per row, one all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 0, n).unsqueeze(1)
    w[torch.arange(n), torch.randint(0, k, (n,), generator=gen)] *= 8
    w[3] = 0
    return w


def test_int8_round_trip_within_half_a_step():
    w = weights()
    q, scale = quantize(w, INT8)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    assert q.abs().max() == 127 and q.min() >= -127  # symmetric: -128 never used
    nonzero = w.abs().amax(dim=1) > 0
    assert (q.abs().amax(dim=1)[nonzero] == 127).all()  # every row reaches the range's end
    err = (w - dequantize(q, scale)).abs()
    assert (err <= scale.unsqueeze(1) / 2 * (1 + 1e-6)).all()
    assert torch.equal(q[3], torch.zeros_like(q[3])) and scale[3] == 1.0  # a zero row stays zeros


def test_fp8_round_trip_three_mantissa_bits():
    w = weights()
    q, scale = quantize(w, FP8)
    assert q.dtype == torch.float8_e4m3fn
    qf = q.float()
    assert not qf.isnan().any() and qf.abs().max() == 448
    err = (w - dequantize(q, scale)).abs()
    normal = (w / scale.unsqueeze(1)).abs() >= 2 ** -6  # e4m3's smallest normal
    assert (err[normal] <= 2 ** -4 * w.abs()[normal] * (1 + 1e-6)).all()
    below = (err / scale.unsqueeze(1))[~normal]
    assert (below <= 2 ** -10 * (1 + 1e-6)).all()  # half the subnormal spacing 2^-9


@pytest.mark.parametrize("scheme", [INT8, FP8], ids=lambda s: s.name)
def test_values_past_the_range_clamp_instead_of_overflowing(scheme):
    w = torch.tensor([[1.0, -1.0, 0.5, 3.0, -1000.0]])
    q = quant.quantize_with_scales(w, torch.tensor([1.0 / scheme.qmax]), scheme)  # 3 and -1000 are past Q
    assert q.float().tolist()[0][3:] == [scheme.qmax, -scheme.qmax]
    assert not q.float().isnan().any()
    # 449/448 would round to 480 in e4m3 (and past 464 to NaN without the clamp)
    if scheme is FP8:
        over = quant.quantize_with_scales(torch.tensor([[449.0, 470.0]]), torch.tensor([1.0]), FP8)
        assert over.float().tolist() == [[448.0, 448.0]]


def test_scales_have_the_wrong_shape():
    with pytest.raises(quant.QuantizationError, match="scales have shape"):
        quant.quantize_with_scales(torch.ones(4, 8), torch.ones(3), INT8)


@pytest.mark.parametrize("scheme", [INT8, FP8], ids=lambda s: s.name)
def test_sharding_a_quantized_weight_equals_quantizing_the_shard(scheme):
    """Column-parallel: each row's scale is its own. Row-parallel: the scale of the whole row,
    applied to this rank's columns, gives the same bytes as slicing the quantized whole."""
    w = weights(n=48, k=96).to(torch.bfloat16)
    q, scale = quantize(w, scheme)
    for rank in range(3):
        rows = slice(16 * rank, 16 * (rank + 1))
        got_q, got_s = quantize(w[rows], scheme)
        want_q, want_s = quant.shard_column_parallel(q, scale, rows.start, rows.stop)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_s, want_s)
        cols = slice(32 * rank, 32 * (rank + 1))
        want_q, want_s = quant.shard_row_parallel(q, scale, cols.start, cols.stop)
        got_q = quant.quantize_with_scales(w[:, cols], channel_scales(w, scheme), scheme)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(want_s, scale)


# ---------------------------------------------------------------- the matmul


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The scheme's product in float64: int8 multiplies the quantized activations (W8A8)."""
    xs = dequantized_activations(x.float()) if q.dtype == torch.int8 else x
    return xs.double() @ dequantize(q, scale).double().t()


def check(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    ref = reference(x, q, scale)
    assert y.dtype == x.dtype and y.shape == ref.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    else:  # bfloat16 output: 2^-8 relative rounding, plus the bfloat16 scales of torch's int8 kernel
        torch.testing.assert_close(y.double(), ref, rtol=1.6e-2, atol=4e-3 * ref.abs().max().item())


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels()
    assert module is not None, "the CPU kernels did not build (g++ and ninja are set up by make setup)"
    return module


# (N, K): the decode shapes' divisibility (K % 32 == 0), K % 16 only, and neither (portable path)
SHAPES = [(96, 576), (40, 48), (22, 40)]


@pytest.mark.parametrize("scheme", [INT8, FP8], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 17, 33])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_float_product(kernels, scheme, dtype, rows, shape):
    n, k = shape
    q, scale = quantize(weights(n, k), scheme)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    check(kernels.quant_linear(x, q, scale), x, q, scale)
    check(quant_linear_torch(x, q, scale), x, q, scale)


# (rows, N, chunk width, chunks): one row, a few (float32 path), 8 (fp8's bfloat16 block path), a
# width of whole 16s only, N not a multiple of 4 (the portable tail)
CHUNKED = [(1, 96, 192, 3), (3, 40, 48, 2), (8, 64, 256, 4), (17, 22, 96, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CHUNKED, ids=str)
def test_chunks_in_one_call_are_each_chunk_alone_and_their_float32_sum(kernels, dtype, case):
    """The layout-invariant numerics' row-parallel product of a quantized weight, as the layer holds
    it (fp8 [C, N, W], int8 packed per chunk): each chunk's product the bits of quant_linear on that
    chunk alone, the sum their float32 sum in chunk order."""
    rows, n, width, chunks = case
    x = torch.randn(rows, width * chunks, generator=torch.Generator().manual_seed(rows)).to(dtype)
    for scheme in (FP8, INT8):
        q, scale = quantize(weights(n, width * chunks, seed=chunks), scheme)
        pieces = q.view(n, chunks, width).transpose(0, 1).contiguous()
        held = pieces if scheme is FP8 else torch.stack([quant.pack_int8(p) for p in pieces])
        alone = [kernels.quant_linear(x[:, j * width:(j + 1) * width].contiguous(), pieces[j], scale)
                 for j in range(chunks)]
        parts = kernels.quant_linear_chunks(x, held, scale, chunks, False)
        assert all(torch.equal(parts[j], alone[j]) for j in range(chunks)), scheme.name
        total = alone[0].float().clone()
        for part in alone[1:]:
            total += part
        assert torch.equal(kernels.quant_linear_chunks(x, held, scale, chunks, True), total.to(dtype)), scheme.name


def test_kernel_is_vectorised_on_this_machine(kernels):
    # -march=native: the AVX-512 path is compiled in wherever the CPU has it
    if cpu_arch() != "native":
        pytest.skip(f"kernels built for -march={cpu_arch()}, not for this machine")
    with open("/proc/cpuinfo") as f:
        has_avx512 = " avx512bw" in f.read()
    assert kernels.quant_linear_vectorized() == has_avx512


def test_quant_linear_keeps_leading_dims_and_runs_without_the_kernels(kernels, monkeypatch):
    q, scale = quantize(weights(64, 96), INT8)
    x = torch.randn(2, 5, 96).to(torch.bfloat16)
    y = quant_linear(x, q, scale)
    assert y.shape == (2, 5, 64)
    check(y.view(10, 64), x.view(10, 96), q, scale)
    long = torch.randn(300, 96)  # a prefill: several row tiles per thread
    check(quant_linear(long, q, scale), long, q, scale)
    monkeypatch.setattr(quant, "kernels_for", lambda t: None)  # no kernel build: torch's ops
    assert quant.pack_int8(q) is q  # nothing to pack for
    check(quant_linear(x, q, scale).view(10, 64), x.view(10, 96), q, scale)


def test_kernel_refuses_what_it_cannot_multiply(kernels):
    q, scale = quantize(weights(8, 32), INT8)
    with pytest.raises(RuntimeError, match="scale must be float32"):
        kernels.quant_linear(torch.randn(1, 32), q, scale.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="q must be int8 or float8_e4m3fn"):
        kernels.quant_linear(torch.randn(1, 32), q.to(torch.int16), scale)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and q \\[N, K\\]"):
        kernels.quant_linear(torch.randn(1, 16), q, scale)


@pytest.mark.parametrize("rows", [1, 3, 32], ids=["float32-path", "float32-path-3", "bfloat16-block-path"])
def test_every_e4m3_value_converts_exactly(kernels, rows):
    """All 254 finite e4m3 bytes (subnormals, ±0, ±448) through the kernel's conversions:
    ``y[m, n] = q[n, m]`` with ``x`` the identity's first rows and unit scales."""
    finite = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    finite = finite[(finite & 0x7F) != 0x7F]
    q = torch.cat([finite, finite[:2]]).view(torch.float8_e4m3fn).view(8, 32)
    eye = torch.eye(32).to(torch.bfloat16)
    for start in range(0, 32, rows):
        y = kernels.quant_linear(eye[start:start + rows], q, torch.ones(8))
        assert torch.equal(y.float(), q.float().t()[start:start + rows])
