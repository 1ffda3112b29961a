"""The fused CPU kernels against their PyTorch reference (services/worker/kernels).

The kernels round where the reference rounds, so results agree to rounding: float32 to ~1e-6, and
in 16-bit an element may differ by one unit in the last place when the float32 statistic of a
norm (a sum taken in a different order) lands on the other side of a rounding boundary."""

from __future__ import annotations

import pytest
import torch

from services.worker.kernels import TorchOps, cpu_kernels, ops_for

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
    for got, want in zip(cpp.add_rms_norm(x, residual, w, 1e-5), REF.add_rms_norm(x, residual, w, 1e-5)):
        close(got, want)
    # a non-contiguous input (a column slice) gives the same result
    wide = torch.randn(rows, 1152, generator=gen).to(dtype)
    close(cpp.rms_norm(wide[:, :576], w, 1e-5), REF.rms_norm(wide[:, :576].contiguous(), w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_q_and_k_only(cpp, dtype):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 9 + 2 * 3, 64, generator=gen).to(dtype)
    cos = torch.randn(7, 1, 32, generator=gen).to(dtype)
    sin = torch.randn(7, 1, 32, generator=gen).to(dtype)
    got, want = qkv.clone(), qkv.clone()
    cpp.rotary_(got, cos, sin, 12)
    REF.rotary_(want, cos, sin, 12)
    close(got, want)
    assert torch.equal(got[:, 12:], qkv[:, 12:])  # v untouched


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


def test_reference_can_be_forced(monkeypatch):
    monkeypatch.setenv("SHARDLINE_CPU_KERNELS", "0")
    assert isinstance(ops_for("cpu"), TorchOps)
