"""GPTQ rounding: the codes it picks are on the scheme's grid with round-to-nearest's scales (so a
plain quantization of its output recovers them exactly), and they keep the layer's output closer
than round-to-nearest does on correlated inputs."""

from __future__ import annotations

import pytest
import torch

from services.modeling.gptq import HessianAccumulator, gptq_round
from services.modeling.quant import FP8, INT8, channel_scales, dequantize, quantize


def correlated(tokens: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) * 0.4 + torch.eye(k)
    return torch.randn(tokens, k, generator=g) @ mix


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    acc.add(x[: len(x) // 2])
    acc.add(x[len(x) // 2:])
    return acc.hessian()


@pytest.mark.parametrize("scheme", [INT8, FP8], ids=lambda s: s.name)
def test_round_to_nearest_recovers_the_codes_and_the_output_error_is_lower(scheme):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 160, generator=g)
    x = correlated(3000, 160, seed=2)
    calibrated = gptq_round(weight, hessian_of(x), scheme, block=64)
    q, scale = quantize(calibrated, scheme)
    assert torch.equal(scale, channel_scales(weight, scheme))  # the scales round-to-nearest gives the original
    assert torch.equal(dequantize(q, scale), calibrated)  # every value is a code times its row's scale
    rtn = dequantize(*quantize(weight, scheme))
    gptq_error = (x @ (weight - calibrated).T).pow(2).mean()
    rtn_error = (x @ (weight - rtn).T).pow(2).mean()
    assert gptq_error < 0.75 * rtn_error, (gptq_error, rtn_error)


def test_an_input_never_seen_rounds_to_nearest_and_the_hessian_shape_is_checked():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(8, 32, generator=g)
    x = correlated(500, 32, seed=4)
    x[:, 5] = 0.0  # column 5 never had an input
    calibrated = gptq_round(weight, hessian_of(x), INT8)
    rtn = dequantize(*quantize(weight, INT8))
    assert torch.equal(calibrated[:, 5], rtn[:, 5])
    with pytest.raises(ValueError, match="hessian has shape"):
        gptq_round(weight, torch.eye(31), INT8)
    with pytest.raises(ValueError, match="no calibration inputs"):
        HessianAccumulator(4).hessian()
