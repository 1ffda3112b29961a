"""The dense bfloat16 kernel on a packed weight (cpu_gemm_packed.cpp, cpu_gemm_stream.cpp), where this machine packs
(AVX512-BF16, no AMX): its products against float32, the same bits for a row in any batch, any
thread count and through K's panels, the layout-invariant chunks, and the rows a tied embedding
reads back from the packed table (a served model's: test_stage_kernel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.modeling.kernels import (
    cpu_kernels,
    dense_linear,
    dense_linear_chunks,
    out_features,
    pack_dense,
    packed_block_rows,
)
from tests.modeling.test_kernels import close

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


@pytest.fixture(scope="module")
def packs():
    w = torch.ones(16, 2, dtype=torch.bfloat16)
    if cpu_kernels() is None or pack_dense(w) is w:
        pytest.skip("this machine keeps dense weights as [N, K]: it has AMX tiles, or neither AVX512-BF16 nor "
                    "AVX2 + FMA, or no C++ toolchain")


def _operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) / k**0.5).bfloat16())


def test_pack_keeps_what_the_kernel_cannot_take():
    for w in (torch.ones(24, 8, dtype=torch.bfloat16), torch.ones(16, 7, dtype=torch.bfloat16),
              torch.ones(16, 8), torch.ones(16, 8, dtype=torch.bfloat16).t()):
        assert pack_dense(w) is w


# N: whole 64-channel tiles and 1-3 blocks over; K: one k-pair, under, across and over a 1,024-k panel;
# rows: a decode row, the 1-3 rows of a tile's tail, streaming columns (AVX512-BF16: 5-64 rows, a tail
# alone, 8-row tiles and a tail; AVX2: 2-48 rows, 4-row tiles), more than 64 rows, and a 256-row block
# with a last few rows joined to it
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (1, 16, 2), (3, 48, 34), (6, 80, 1024), (21, 208, 2050),
                                   (70, 144, 2050), (1, 2048, 8192), (65, 112, 3000), (300, 48, 130)])
def test_packed_products_match_the_float32_product(packs, m, n, k):
    x, w = _operands(m, n, k)
    packed = pack_dense(w)
    assert packed.shape == (n // 16, k // 2, 16, 2) and out_features(packed) == n
    close(dense_linear(x, packed), F.linear(x.float(), w.float()).bfloat16())
    assert torch.equal(dense_linear(x.view(1, m, k), packed), dense_linear(x, packed).view(1, m, n))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(960, 576), (208, 2050)])
def test_a_row_has_the_same_bits_in_any_batch(packs, threads, n, k):
    x, w = _operands(70, n, k, seed=1)
    packed = pack_dense(w)
    full = dense_linear(x, packed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(dense_linear(x, packed), full)
        for i in (0, 3, 64, 69):  # alone: the decode tile, K whole in registers
            assert torch.equal(dense_linear(x[i:i + 1], packed)[0], full[i]), i
        # streaming columns (AVX512-BF16: 5-64 rows, AVX2: 2-48), 4-row tiles
        for a, b in ((0, 3), (5, 7), (5, 9), (60, 70), (0, 13), (3, 52), (3, 67)):
            assert torch.equal(dense_linear(x[a:b], packed), full[a:b]), (a, b)
    finally:
        torch.set_num_threads(before)


# the sum is made in the kernel as each chunk ends: one row (a chunk per tile call), 1-3 rows left
# after 4-row tiles, two row blocks (256 + 74), chunks longer than a 1,024-pair panel, 32 chunks of 32 pairs,
# streaming columns (7 and 19 rows)
@pytest.mark.parametrize("rows,n,k,chunks", [(1, 576, 1536, 4), (7, 64, 768, 8), (70, 48, 2048 * 2, 2),
                                             (1, 2048, 2048, 32), (3, 576, 1152, 6), (330, 80, 4400, 2),
                                             (6, 1024, 2048, 32), (19, 80, 4400, 2)])
def test_packed_chunks_are_each_chunk_alone_at_every_tensor_parallel_degree(packs, rows, n, k, chunks):
    """Chunk j of the packed [N, K] weight gives the bits of chunk j's own columns packed alone,
    as a TP rank holding only them does; the sum is the chunks' float32 sum in order."""
    x, w = _operands(rows, n, k, seed=2)
    packed, width = pack_dense(w), k // chunks
    parts = dense_linear_chunks(x, packed, chunks, sum=False)
    for j in range(chunks):
        cut = slice(j * width, (j + 1) * width)
        assert torch.equal(parts[j], dense_linear(x[:, cut].contiguous(), pack_dense(w[:, cut].contiguous()))), j
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    assert torch.equal(dense_linear_chunks(x, packed, chunks, sum=True), total.bfloat16())
    local = k // 2  # "TP2": each rank packs its half on its own
    halves = [dense_linear_chunks(x[:, r * local:(r + 1) * local].contiguous(),
                                  pack_dense(w[:, r * local:(r + 1) * local].contiguous()), chunks // 2, sum=False)
              for r in range(2)]
    assert torch.equal(torch.cat(halves), parts)


def test_packed_rows_read_back_the_weight(packs):
    _, w = _operands(1, 96, 70)
    ids = torch.tensor([0, 95, 17, 17, 40])
    assert torch.equal(packed_block_rows(pack_dense(w), ids, 70), w[ids])

