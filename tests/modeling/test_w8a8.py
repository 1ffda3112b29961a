"""The int8 scheme's W8A8 matmul (kernels/cpu_w8a8.cpp): activations quantized per group of 32,
integer group sums, float32 across groups.

The vectorised path (AVX512-VNNI or AVX2, whichever this build has) against the portable one: the
same bits, since every group sum is an exact integer and the groups are added in the same order;
both against an exact float64 product of the quantized activations. test_kernels.py runs this file
against the AVX2 build too."""

from __future__ import annotations

import pytest
import torch

from services.modeling.kernels import cpu_arch, cpu_kernels
from services.modeling.quant import (
    ACTIVATION_GROUP,
    INT8,
    pack_int8,
    packed_rows,
    quant_linear,
    quantize,
    quantize_activations,
)

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels()
    assert module is not None, "the CPU kernels did not build (g++ and ninja are set up by make setup)"
    return module


def case(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize(torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n).unsqueeze(1), INT8)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 1, k)  # groups of very different sizes
    x[0, :ACTIVATION_GROUP] = 0  # an all-zero group: scale 0, values 0
    return x.to(dtype), q, scale


def exact(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Σ_g d[m, g] · (xq · q)_g · scale[n] in float64: each group's integer sum exactly."""
    xq, d = quantize_activations(x)
    groups = d.shape[1]
    qp = torch.nn.functional.pad(q.double(), (0, xq.shape[1] - q.shape[1])).view(q.shape[0], groups, -1)
    sums = torch.einsum("mgk,ngk->mng", xq.double().view(x.shape[0], groups, -1), qp)
    return (sums * d.double().unsqueeze(1)).sum(2) * scale.double()


# (M, N, K): decode and prefill rows, N not a multiple of 16, K not a multiple of 32; K past the
# streaming columns' 64-group panel (4,130: three panels, the last of 2 groups) at 2 rows (one tile
# short of 4 rows) and at 13 (three 4-row tiles sharing out the next panel, and one row left)
SHAPES = [(1, 576, 576), (3, 96, 1536), (4, 40, 70), (17, 960, 576), (33, 22, 40), (1, 200, 2048),
          (2, 112, 4130), (13, 80, 4130)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_vectorised_path_has_the_portable_bits_and_the_exact_product(kernels, dtype, shape):
    x, q, scale = case(*shape, dtype, seed=shape[2])
    packed = kernels.w8a8_pack(q)
    y = kernels.w8a8_linear(x, packed, scale)
    assert y.dtype == dtype and y.shape == (shape[0], shape[1])
    assert torch.equal(y, kernels.w8a8_linear(x, packed, scale, vectorized=False))
    want = exact(x, q, scale)
    if dtype == torch.float32:  # only float32 rounding of the group terms
        torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    else:  # and the output's bfloat16 rounding
        torch.testing.assert_close(y.double(), want, rtol=2 ** -8, atol=1e-6 * want.abs().max().item())


def test_a_row_has_the_same_bits_in_any_batch(kernels):
    """Each row's activations are quantized on their own and its sums taken the same way at every
    M: a sequence's logits do not depend on what shares its step."""
    x, q, scale = case(37, 960, 576, torch.bfloat16, seed=5)
    packed = kernels.w8a8_pack(q)
    whole = kernels.w8a8_linear(x, packed, scale)
    for rows in (slice(0, 1), slice(5, 9), slice(3, 20), slice(36, 37)):
        assert torch.equal(kernels.w8a8_linear(x[rows], packed, scale), whole[rows]), rows


# (M, N, K, chunks): one row (8-block tiles), rows left after 4-row tiles, N tails, 2-8 chunks;
# chunks of 129 groups, each three of the streaming columns' panels (the sums kept between them)
CHUNKED = [(1, 576, 576, 3), (1, 160, 1024, 8), (6, 40, 384, 2), (7, 96, 1536, 3), (70, 48, 512, 4),
           (9, 56, 8256, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", CHUNKED, ids=str)
def test_chunks_are_each_chunk_alone_and_their_float32_sum(kernels, dtype, shape):
    """The layout-invariant numerics' row-parallel product in one call: each fixed k-chunk's
    product has the bits of that chunk's columns packed and multiplied alone (what a TP rank
    holding only them computes), and the sum is their float32 sum in chunk order."""
    m, n, k, chunks = shape
    x, q, scale = case(m, n, k, dtype, seed=k + chunks)
    packed, width = kernels.w8a8_pack(q), k // chunks
    alone = [kernels.w8a8_linear(x[:, j * width:(j + 1) * width].contiguous(),
                                 kernels.w8a8_pack(q[:, j * width:(j + 1) * width].contiguous()), scale)
             for j in range(chunks)]
    for vectorized in (True, False):
        parts = kernels.w8a8_linear_chunks(x, packed, scale, chunks, False, vectorized=vectorized)
        assert parts.shape == (chunks, m, n) and all(torch.equal(parts[j], alone[j]) for j in range(chunks))
        total = alone[0].float().clone()  # float32: .float() alone would be alone[0] itself
        for part in alone[1:]:
            total += part
        summed = kernels.w8a8_linear_chunks(x, packed, scale, chunks, True, vectorized=vectorized)
        assert torch.equal(summed, total.to(dtype)), vectorized
    with pytest.raises(RuntimeError, match="chunks of whole groups"):
        kernels.w8a8_linear_chunks(x[:, :k - 32], kernels.w8a8_pack(q[:, :k - 32]), scale, chunks * 2 + 1, True)


def test_quant_linear_takes_int8_packed_or_not(kernels):
    x, q, scale = case(6, 64, 100, torch.bfloat16)
    packed = pack_int8(q)  # K padded to 128
    assert packed is not None and packed.dtype == torch.uint8 and packed.shape == (4, 128 // 4, 16, 4)
    assert torch.equal(quant_linear(x, packed, scale), quant_linear(x, q, scale))
    assert torch.equal(kernels.quant_linear(x, packed, scale), kernels.w8a8_linear(x, packed, scale))


def test_packed_rows_read_back_the_int8_weight(kernels):
    _, q, _ = case(1, 50, 70, torch.float32)
    ids = torch.tensor([0, 49, 17, 16, 15, 17])
    assert torch.equal(packed_rows(kernels.w8a8_pack(q), ids, 70), q[ids])


def test_a_code_of_minus_128_packs_as_minus_127(kernels):
    """llm-compressor's int8 scale is max|row| / 127.5, so its codes reach -128; AVX2's sign trick
    cannot make +128, so every path takes -128 as -127 (the same bits everywhere)."""
    q = torch.full((16, 32), -128, dtype=torch.int8)
    q[:, 1::2] = 5
    packed = kernels.w8a8_pack(q)
    assert torch.equal(packed_rows(packed, torch.arange(16), 32), q.clamp(min=-127))
    x = -torch.ones(3, 32)  # negative activations: where the sign trick would flip -128's product
    y = kernels.w8a8_linear(x, packed, torch.ones(16))
    assert torch.equal(y, kernels.w8a8_linear(x, packed, torch.ones(16), vectorized=False))
    assert torch.equal(y, torch.full((3, 16), 16 * 127.0 - 16 * 5.0))


def test_activations_quantize_as_the_kernel_does(kernels):
    """One weight row of unit values picks out each activation group's d · Σ xq: the kernel's
    quantized activations are quantize_activations'."""
    x, _, _ = case(5, 1, 96, torch.float32, seed=3)
    xq, d = quantize_activations(x)
    assert xq.abs().max() <= 127 and torch.equal(xq, xq.round())
    for g in range(3):
        q = torch.zeros(1, 96, dtype=torch.int8)
        q[0, g * 32:(g + 1) * 32] = 1
        y = kernels.w8a8_linear(x, kernels.w8a8_pack(q), torch.ones(1))
        assert torch.equal(y[:, 0], d[:, g] * xq[:, g * 32:(g + 1) * 32].sum(1))


def test_kernel_refuses_a_packed_weight_of_another_shape(kernels):
    _, q, scale = case(1, 32, 64, torch.float32)
    with pytest.raises(RuntimeError, match="is not w8a8_pack of an \\[32, 96\\] weight"):
        kernels.w8a8_linear(torch.randn(2, 96), kernels.w8a8_pack(q), scale)


def test_the_integer_dot_product_path_is_built_where_the_machine_has_it(kernels):
    if cpu_arch() != "native":
        pytest.skip(f"kernels built for -march={cpu_arch()}, not for this machine")
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    want = ("avx512-vnni" if " avx512_vnni" in flags and " avx512bw" in flags
            else "avx2" if " avx2" in flags else "portable")
    assert kernels.w8a8_path() == want
