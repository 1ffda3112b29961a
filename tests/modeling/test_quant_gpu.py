"""The quantized matmul and a quantized tiny model on CUDA (``gpu``: skipped without a device).

The same model code runs there: ``quant_linear`` takes torch's CUDA kernels (``_scaled_mm`` with
e4m3 activations on sm89+ for fp8; int8 converted to bfloat16 whole, then multiplied)."""

from __future__ import annotations

import pytest
import torch

from services.modeling.attention import AttentionMetadata
from services.modeling.config import ModelConfig
from services.modeling.parallel.plan import ParallelPlan
from services.modeling.quant import FP8, INT8, dequantize, quant_linear, quantize
from tests.modeling.test_quant import weights
from tests.modeling.test_quant_model import loaded

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scheme", [INT8, FP8], ids=lambda s: s.name)
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_cuda_quant_linear_matches_the_float_product(scheme, rows):
    q, scale = quantize(weights(256, 576), scheme)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    ref = x.double() @ dequantize(q, scale).double().t()
    y = quant_linear(x.cuda(), q.cuda(), scale.cuda()).cpu()
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    # fp8 on sm89+ also quantizes the activations to e4m3: a few % per element
    rtol = 6e-2 if scheme is FP8 else 1.6e-2
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_cuda_tiny_quantized_logits_near_bfloat16(tiny_model_dir, dtype):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    ids = torch.randint(0, cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in ("bfloat16", dtype):
        model = loaded(tiny_model_dir, ParallelPlan(cfg, 1, 1, name), device="cuda")
        hidden = model(torch.arange(32).cuda(), AttentionMetadata.prefill([32]), input_ids=ids.cuda())
        out[name] = model.compute_logits(hidden).cpu()
    assert (out[dtype] - out["bfloat16"]).abs().max() <= 0.15 * out["bfloat16"].abs().max()
