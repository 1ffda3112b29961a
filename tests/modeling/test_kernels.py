"""The fused CPU kernels against their PyTorch reference (services/modeling/kernels).

The kernels round where the reference rounds, so results agree to rounding: float32 to ~1e-6, and
in 16-bit an element may differ by one unit in the last place when the float32 statistic of a
norm (a sum taken in a different order) lands on the other side of a rounding boundary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.modeling.attention import AttentionMetadata
from services.modeling.kernels import (
    TorchOps,
    cpu_arch,
    cpu_kernels,
    dense_linear,
    dense_linear_chunks,
    dense_linear_vectorized,
    greedy_logsumexp,
    ops_for,
)

REF = TorchOps()


@pytest.fixture(scope="module")
def cpp():
    ops = ops_for("cpu")
    assert cpu_kernels() is not None, "the CPU kernels did not build (g++ and ninja are set up by make setup)"
    return ops


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    else:  # one unit in the last place
        torch.testing.assert_close(a, b, rtol=2 * torch.finfo(a.dtype).eps, atol=1e-5)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 rows run across threads
def test_norms(cpp, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    close(cpp.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5))
    got = (x.clone(), residual.clone())
    want = (x.clone(), residual.clone())
    cpp.add_rms_norm_(*got, w, 1e-5)
    REF.add_rms_norm_(*want, w, 1e-5)
    close(got[1], residual + x)  # residual <- x + residual
    for g, r in zip(got, want):
        close(g, r)
    # a non-contiguous input (a column slice) gives the same result
    wide = torch.randn(rows, 1152, generator=gen).to(dtype)
    close(cpp.rms_norm(wide[:, :576], w, 1e-5), REF.rms_norm(wide[:, :576].contiguous(), w, 1e-5))


@pytest.mark.parametrize("d", [64, 128, 48])  # 48: bfloat16 without the 16-lane loop
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_q_and_k_only(cpp, dtype, d):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 9 + 2 * 3, d, generator=gen).to(dtype)
    cos = torch.randn(7, 1, d // 2, generator=gen).to(dtype)
    sin = torch.randn(7, 1, d // 2, generator=gen).to(dtype)
    got, want = qkv.clone(), qkv.clone()
    cpp.rotary_(got, cos, sin, 12)
    REF.rotary_(want, cos, sin, 12)
    close(got, want)
    if dtype == torch.bfloat16:  # the reference's roundings, bit for bit
        assert torch.equal(got, want)
    assert torch.equal(got[:, 12:], qkv[:, 12:])  # v untouched


def test_silu_and_mul_16_lanes_give_the_scalar_loops_bits(cpp):
    """A bfloat16 row runs 16 lanes at a time and its last inter % 16 elements in the scalar loop:
    each value gets the same bits in a lane as in the tail."""
    gen = torch.Generator().manual_seed(3)
    values = (4 * torch.randn(2, 16, generator=gen)).bfloat16()  # gate, up
    values[0, :4] = torch.tensor([0.0, -0.0, 87.0, -90.0])
    gate_up = torch.zeros(17, 2 * 17, dtype=torch.bfloat16)
    gate_up[0, :16], gate_up[0, 17:33] = values[0], values[1]  # row 0: the lanes
    gate_up[1:, 16], gate_up[1:, 33] = values[0], values[1]  # row j: value j - 1 in the tail
    out = cpp.silu_and_mul(gate_up)
    assert torch.equal(out[0, :16], out[1:, 16])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(cpp, dtype):
    gate_up = (3 * torch.randn(20, 2 * 1536, generator=torch.Generator().manual_seed(2))).to(dtype)
    close(cpp.silu_and_mul(gate_up), REF.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_from_strided_projection(cpp, dtype):
    qkv = torch.randn(5, 15, 64).to(dtype)
    k, v = qkv[:, 9:12], qkv[:, 12:]  # views into the fused projection, as the model passes them
    slots = torch.tensor([3, 17, 40, 63, 0])
    caches = [torch.zeros(4, 16, 3, 64, dtype=dtype) for _ in range(4)]
    cpp.write_kv(caches[0], caches[1], k, v, slots)
    REF.write_kv(caches[2], caches[3], k, v, slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0].view(-1, 3, 64)[17], k[1])


def paged_batch(dtype, context_lens, *, kv_heads=3, group=3, d=64, block_size=16, seed=0):
    """Caches with each sequence's context in shuffled blocks, a q as the model passes it (a
    strided view into the fused projection), and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    caches = [torch.randn(n_blocks, block_size, kv_heads, d, generator=gen).to(dtype) for _ in range(2)]
    order = torch.randperm(n_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in context_lens)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int64)
    for i, n in enumerate(context_lens):
        for j in range(-(-n // block_size)):
            tables[i, j] = order.pop()
    heads = kv_heads * group
    qkv = torch.randn(len(context_lens), heads + 2 * kv_heads, d, generator=gen).to(dtype)
    meta = AttentionMetadata(query_lens=[1] * len(context_lens), context_lens=list(context_lens),
                             block_tables=tables)
    return qkv[:, :heads], caches, meta


@pytest.mark.parametrize("vectorized", [True, False], ids=["avx512", "portable"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("context_lens", "group", "d"), [
    ([1], 3, 64), ([37], 3, 64), ([5, 16, 17, 90, 1, 33], 3, 64), ([200] * 16, 3, 64),
    ([9, 40], 8, 128), ([31, 1, 64], 5, 64), ([20, 3], 1, 80)])  # 8 and 5 heads per KV head; d = 80 has no AVX path
def test_decode_attention_reads_blocks_in_place(cpp, dtype, context_lens, group, d, vectorized):
    q, (k_cache, v_cache), meta = paged_batch(dtype, context_lens, group=group, d=d, seed=len(context_lens))
    got = cpu_kernels().decode_attention(q, k_cache, v_cache, meta.block_tables,
                                         meta.context_lens_tensor(q.device), 0.125, vectorized=vectorized)
    want = REF.decode_attention(q, k_cache, v_cache, meta, 0.125)
    heads = 3 * group
    assert got.shape == want.shape == (len(context_lens), heads, d) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # SDPA rounds its probabilities to the 16-bit dtype before p·v; the kernel keeps float32
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_with_blocks_a_tile_cannot_take(cpp, dtype):
    """Blocks of 8 tokens: on an AMX machine the bfloat16 scores are not computed on tiles (a
    tile is 16 rows of one block) but by the vector path, which must agree as well."""
    q, (k_cache, v_cache), meta = paged_batch(dtype, [5, 37, 70], block_size=8, seed=4)
    got = cpp.decode_attention(q, k_cache, v_cache, meta, 0.125)
    want = REF.decode_attention(q, k_cache, v_cache, meta, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_takes_each_token_as_a_decode_row(cpp, dtype):
    """A mixed step (a whole prompt, a decode, a second chunk) against SDPA per sequence; and a
    token's result does not depend on the chunk it came in."""
    context_lens, query_lens = [23, 40, 70], [23, 1, 30]
    q, (k_cache, v_cache), meta = paged_batch(dtype, context_lens, seed=7)
    q = torch.randn(sum(query_lens), *q.shape[1:]).to(dtype)
    meta.query_lens = query_lens
    got = cpp.prefill_attention(q, k_cache, v_cache, meta, 0.125)
    want = REF.prefill_attention(q, k_cache, v_cache, meta, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # the third sequence's last 30 tokens as two chunks of 10 and 20
    tail = q[24:]
    for lo, hi in [(0, 10), (10, 30)]:
        chunk = AttentionMetadata(query_lens=[hi - lo], context_lens=[40 + hi], block_tables=meta.block_tables[2:])
        assert torch.equal(cpp.prefill_attention(tail[lo:hi], k_cache, v_cache, chunk, 0.125), got[24 + lo:24 + hi])


@pytest.mark.parametrize(("group", "d"), [(3, 64), (8, 128), (5, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_row_has_the_bits_of_its_token_decoded_alone(cpp, dtype, group, d):
    """The kernel may take a prefill's rows together (on AMX tiles, up to 16 query heads at a
    time): each row still has the bits of the same token as a decode step of its own."""
    q, (k_cache, v_cache), meta = paged_batch(dtype, [70], group=group, d=d, seed=9)
    q = torch.randn(30, *q.shape[1:]).to(dtype)
    meta.query_lens = [30]
    rows = cpp.prefill_attention(q, k_cache, v_cache, meta, 0.125)
    for j in range(30):
        alone = AttentionMetadata(query_lens=[1], context_lens=[41 + j], block_tables=meta.block_tables)
        assert torch.equal(cpp.decode_attention(q[j:j + 1], k_cache, v_cache, alone, 0.125), rows[j:j + 1]), j


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_sharing_cached_blocks_keep_their_own_bits(cpp, dtype):
    """Sequences whose tables start with the same blocks (a cached prefix) may share tiles in a
    decode step: each row has the bits it has alone, and agrees with the reference."""
    q, (k_cache, v_cache), meta = paged_batch(dtype, [40, 20, 33], seed=11)
    meta.block_tables[1:, :2] = meta.block_tables[0, :2]  # both others start on the first's two blocks
    rows = cpp.decode_attention(q, k_cache, v_cache, meta, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(rows, REF.decode_attention(q, k_cache, v_cache, meta, 0.125), rtol=tol, atol=tol)
    for i, ctx in enumerate(meta.context_lens):
        alone = AttentionMetadata(query_lens=[1], context_lens=[ctx], block_tables=meta.block_tables[i:i + 1])
        assert torch.equal(cpp.decode_attention(q[i:i + 1], k_cache, v_cache, alone, 0.125), rows[i:i + 1]), i


def test_decode_attention_rejects_a_table_too_short(cpp):
    q, (k_cache, v_cache), meta = paged_batch(torch.float32, [20])
    meta.context_lens = [40]
    with pytest.raises(RuntimeError, match="outside the block table"):
        cpp.decode_attention(q, k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_logsumexp(cpp, monkeypatch, dtype):
    gen = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(16, 49152, generator=gen)).to(dtype)
    logits[3, 100] = logits[3, 40000] = logits[3].max() + 1  # a tie: the first index wins, as argmax
    logits[5, :] = -torch.inf
    logits[5, 7] = 2.0  # one finite logit
    ids, lse = greedy_logsumexp(logits)
    values = logits.float()
    assert ids.tolist() == values.argmax(dim=-1).tolist() and ids[3] == 100
    torch.testing.assert_close(lse, torch.logsumexp(values, dim=-1), rtol=2e-6, atol=2e-6)
    monkeypatch.setenv("SHARDLINE_CPU_KERNELS", "0")  # the PyTorch path gives the same
    ref_ids, ref_lse = greedy_logsumexp(logits)
    assert torch.equal(ref_ids, ids)
    torch.testing.assert_close(ref_lse, lse, rtol=2e-6, atol=2e-6)


def test_greedy_logsumexp_nan_row_is_reported_not_hidden(cpp):
    logits = torch.zeros(2, 1000)
    logits[1, 500] = float("nan")
    ids, lse = greedy_logsumexp(logits)
    assert ids.tolist() == [0, 500] and torch.isnan(lse[1]) and lse[0] == pytest.approx(6.907755, rel=1e-6)


def test_reference_can_be_forced(monkeypatch):
    monkeypatch.setenv("SHARDLINE_CPU_KERNELS", "0")
    assert isinstance(ops_for("cpu"), TorchOps)


@pytest.fixture()
def gemm(cpp):
    if not dense_linear_vectorized():
        pytest.skip("neither AVX512-BF16 nor AVX2 here: dense_linear is F.linear")


def _dense(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen).bfloat16(), (0.05 * torch.randn(n, k, generator=gen)).bfloat16())


# K not a multiple of 32 (a zero-filled last chunk), N not a multiple of 4 or 8, M across the tiles;
# on a machine with AMX the shapes with K % 32 == 0 and N % 16 == 0 take the tile kernel, M across
# its row blocks (16 rows, then M % 16)
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (1, 9, 31), (3, 7, 33), (5, 13, 100), (17, 577, 1536),
                                   (300, 36, 64), (64, 3, 576), (130, 49, 1000), (2, 48, 1536), (33, 80, 64),
                                   (16, 3072, 576), (250, 112, 96)])
def test_dense_linear_matches_the_float32_product(gemm, m, n, k):
    x, w = _dense(m, n, k, seed=m * n + k)
    close(dense_linear(x, w), F.linear(x.float(), w.float()).bfloat16())


def test_dense_linear_strided_x_and_leading_dims(gemm):
    x, w = _dense(12, 40, 200, seed=1)
    wide = torch.zeros(12, 400, dtype=torch.bfloat16)
    wide[:, ::2] = x
    strided = wide[:, ::2]  # the same values, not contiguous
    assert torch.equal(dense_linear(strided, w), dense_linear(x, w))
    assert torch.equal(dense_linear(x.view(3, 4, 200), w), dense_linear(x, w).view(3, 4, 40))
    close(dense_linear(x.t().contiguous().t(), w), F.linear(x.float(), w.float()).bfloat16())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(963, 576), (37, 100), (960, 576), (80, 64)])  # the last two: AMX tiles where there are
def test_dense_linear_is_batch_invariant(gemm, threads, n, k):
    """Row i of the result has the same bits alone, in any slice, next to other rows and with any
    thread count: one order of summation per element."""
    x, w = _dense(64, n, k, seed=n)
    full = dense_linear(x, w)  # the default thread count
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(dense_linear(x, w), full)
        for i in range(64):
            assert torch.equal(dense_linear(x[i:i + 1], w)[0], full[i]), i
        for a, b in [(0, 2), (0, 4), (3, 20), (7, 8), (1, 50), (10, 64), (5, 9)]:
            assert torch.equal(dense_linear(x[a:b], w), full[a:b]), (a, b)
        other = x.clone()
        other[5:] = torch.randn(59, k).bfloat16()  # different neighbours
        assert torch.equal(dense_linear(other, w)[:5], full[:5])
    finally:
        torch.set_num_threads(before)


# the layout-invariant numerics' row-parallel product: 12 k-chunks (TP 1, 2, 3, 4 and 6 each hold
# whole ones); K per chunk a multiple of 32 (AMX tiles where there are), then not (a zero-filled tail)
@pytest.mark.parametrize("rows,n,k", [(1, 576, 1536), (7, 64, 768), (1, 40, 12 * 36), (19, 9, 12 * 20)])
def test_fixed_chunks_sum_to_the_same_bits_at_every_tensor_parallel_degree(gemm, rows, n, k):
    """A row-parallel layer's product in the layout-invariant numerics, as each TP degree computes
    it: every rank's chunk products from its own k-slice of x and the weight (a contiguous copy,
    as a rank loads it), gathered in rank order and summed in float32 in that order, equal TP1's
    one call to the bit; and each chunk's product equals dense_linear of that chunk alone."""
    x, w = _dense(rows, n, k, seed=k)
    chunks, width = 12, k // 12
    whole = dense_linear_chunks(x, w, chunks, sum=True)
    parts = dense_linear_chunks(x, w, chunks, sum=False)
    for j in range(chunks):
        cut = slice(j * width, (j + 1) * width)
        assert torch.equal(parts[j], dense_linear(x[:, cut], w[:, cut].contiguous())), j
    for tp in (1, 2, 3, 4, 6):
        local = k // tp
        gathered = torch.cat([dense_linear_chunks(x[:, r * local:(r + 1) * local],
                                                  w[:, r * local:(r + 1) * local].contiguous(), chunks // tp,
                                                  sum=False) for r in range(tp)])
        total = gathered[0].float()
        for part in gathered[1:]:
            total += part
        assert torch.equal(total.bfloat16(), whole), tp


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_float32_chunks_are_one_batched_matmul_with_each_chunks_bits_at_every_degree(cpp, rows):
    """float32 (no vector kernel of ours; the fused decoder-layer call's path, and as the layer does
    it in torch): the chunks' products in one batched matmul, a chunk's product the same whichever
    chunks share the call, so every TP degree's gathered sum is TP1's. (Not always the bits of
    torch's linear on the chunk alone: oneDNN blocks a lone matmul differently at some shapes.)"""
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 12 * 48, generator=gen), torch.randn(40, 12 * 48, generator=gen)
    chunks = cpu_kernels().dense_linear_chunks
    whole, parts = chunks(x, w, 12, True), chunks(x, w, 12, False)
    for j in range(12):
        torch.testing.assert_close(parts[j], torch.nn.functional.linear(x[:, j * 48:(j + 1) * 48],
                                                                        w[:, j * 48:(j + 1) * 48]))
    for tp in (2, 3, 4, 6):
        local = 12 * 48 // tp
        gathered = torch.cat([chunks(x[:, r * local:(r + 1) * local].contiguous(),
                                     w[:, r * local:(r + 1) * local].contiguous(), 12 // tp, False) for r in range(tp)])
        total = gathered[0].clone()
        for part in gathered[1:]:
            total += part
        assert torch.equal(total, whole), tp


def test_the_avx2_build_passes_the_matmul_attention_and_layout_invariance_tests(tmp_path):
    """What an AVX2-only machine runs (AMD EPYC before Zen 4, Intel before Cooper Lake): the kernels
    written per instruction set built here with -march=x86-64-v3 and put through this file's
    dense_linear and attention tests, the packed weights' (test_gemm_packed.py) and the quantized
    matmuls' (test_quant.py, test_w8a8.py) in a subprocess; and the models of
    test_layout_invariance.py on them (bfloat16, int8 and fp8 bits the same at TP1, TP2, TP4,
    TP2 x PP2, TP3 and PP3), every rank's process on the same kernels (vector_build.py)."""
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    if cpu_arch() != "native" or " avx2" not in flags or " fma" not in flags:
        pytest.skip("the AVX2 build is checked from a native build on an x86 machine with AVX2 + FMA")
    if " avx512f" not in flags:
        # the native build here is the AVX2 build, and the whole suite runs on it: a second copy
        # for x86-64-v3 would test the same paths again (107 s of compiling on a 2-core AMD EPYC)
        pytest.skip("this machine has no AVX-512: its native build is the AVX2 build under test")
    # the kernels written per instruction set alone (tests/modeling/vector_build.py): half the compile
    env = {**os.environ, "SHARDLINE_CPU_ARCH": "x86-64-v3"}
    script = ("from services.modeling.kernels import vector_kernels\n"
              "m = vector_kernels('x86-64-v3')\n"
              "assert m.dense_linear_vectorized() and not m.amx_ready() and not m.quant_linear_vectorized()\n"
              "assert m.w8a8_path() == 'avx2'")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", script], cwd=root, env=env, check=True, timeout=600)
    tests = [f"{__file__}::{name}" for name in ("test_dense_linear_matches_the_float32_product",
                                                "test_dense_linear_strided_x_and_leading_dims",
                                                "test_dense_linear_is_batch_invariant",
                                                "test_fixed_chunks_sum_to_the_same_bits_at_every_tensor_parallel_degree",
                                                "test_decode_attention_reads_blocks_in_place",
                                                "test_decode_attention_with_blocks_a_tile_cannot_take",
                                                "test_prefill_attention_takes_each_token_as_a_decode_row",
                                                "test_a_prefill_row_has_the_bits_of_its_token_decoded_alone",
                                                "test_decode_rows_sharing_cached_blocks_keep_their_own_bits")]
    # the ranks' processes (a fork server's children) load the plugin as they start
    (tmp_path / "sitecustomize.py").write_text("import tests.modeling.vector_build  # noqa: F401\n")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(root)])
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                          "-p", "tests.modeling.vector_build", *tests,
                          *(str(Path(__file__).with_name(name))
                            for name in ("test_gemm_packed.py", "test_quant.py", "test_w8a8.py")),
                          str(root / "tests" / "worker" / "test_layout_invariance.py")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    # skipped there: test_quant's and test_w8a8's checks of which path is built for this CPU;
    # deselected: SmolLM2 at TP3 and PP3 (slow)
    assert run.returncode == 0 and " passed, 2 skipped, 1 deselected" in run.stdout, run.stdout[-3000:]


def test_amx_tiles_are_used_where_the_machine_has_them(cpp):
    """-march=native compiles the tile kernel in where the CPU has AMX-BF16; the kernel then asks
    Linux for the tile state, which it grants from 5.16 on."""
    if cpu_arch() != "native":
        pytest.skip(f"kernels built for -march={cpu_arch()}, not for this machine")
    with open("/proc/cpuinfo") as f:
        has_amx = " amx_bf16" in f.read()
    if os.environ.get("SHARDLINE_AMX") in ("0", "false"):
        has_amx = False
    assert cpu_kernels().amx_ready() == has_amx


def test_dense_linear_uses_f_linear_otherwise(cpp, monkeypatch):
    x, w = _dense(6, 20, 64, seed=2)
    assert torch.equal(dense_linear(x.float(), w.float()), F.linear(x.float(), w.float()))  # float32 plans
    monkeypatch.setenv("SHARDLINE_CPU_KERNELS", "0")
    assert not dense_linear_vectorized()
    assert torch.equal(dense_linear(x, w), F.linear(x, w))



def test_mask_tokens_keeps_exactly_the_allowed_bits():
    from services.modeling import kernels

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=gen)
    masks = torch.randint(0, 256, (5, 120), dtype=torch.uint8, generator=gen)  # 960 bits: the last 40 tokens masked
    masks[1] = 0xFF
    masks[2] = 0
    got = logits.clone()
    kernels.mask_tokens_(got, masks)
    bits = ((masks[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(1).bool()
    allowed = torch.cat([bits, torch.zeros(5, 40, dtype=torch.bool)], dim=1)
    assert torch.equal(got, logits.masked_fill(~allowed, float("-inf")))
    assert torch.isinf(got[2]).all() and torch.equal(got[1, :960], logits[1, :960])


def test_the_precompiled_header_has_the_flags_of_the_units_it_is_included_in(cpp):
    """GCC takes a precompiled header only where it was compiled with the units' own flags (else it
    reads the headers' text, slower but the same build): the flags it is compiled with are those
    torch wrote into the build's ninja file, and the build includes it."""
    from torch.utils.cpp_extension import _get_build_directory

    from services.modeling.kernels.pch import torch_cflags

    # the build's own directory (a published build's module is a copy: kernels/published.py)
    build_dir = Path(_get_build_directory(Path(cpu_kernels().__file__).stem, verbose=False))
    ninja = (build_dir / "build.ninja").read_text()
    (line,) = [line for line in ninja.splitlines() if line.startswith("cflags = ")]
    units, _, pch = line.removeprefix("cflags = ").partition(" -include ")
    header, _, rest = pch.partition(" ")
    assert rest == "-Winvalid-pch" and Path(f"{header}.gch").is_file(), line
    name = build_dir.name
    ours = units.split(f"-DTORCH_EXTENSION_NAME={name} ", 1)[1]
    extra = ours.split(" -std=c++20 ", 1)[1].split(" ")
    # the torch the build included (a published build: the venv of the checkout that built it)
    built_with = units.split("-isystem ", 1)[1].split(" ", 1)[0].removesuffix("/include")
    assert " ".join(torch_cflags(name, extra)).replace(str(Path(torch.__file__).parent), built_with) == units
