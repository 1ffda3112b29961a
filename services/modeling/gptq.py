"""Calibrated rounding (GPTQ) onto a quantization scheme's grid: the same stored format as
:mod:`services.modeling.quant` (per-output-channel scales, int8 or e4m3 codes), chosen to keep the
layer's *output* close instead of each weight.

Round-to-nearest picks each code ``q[n, k]`` on its own. For a linear layer ``y = x Wᵀ`` what
matters is the output error ``‖X (W − Ŵ)ᵀ‖²`` over real inputs ``X``, whose second moment is the
Hessian ``H = 2 XᵀX / T`` [K, K]. GPTQ quantizes the columns ``k = 0 .. K−1`` in order and, after
each, spreads that column's rounding error over the columns not yet quantized, in the
proportions ``H⁻¹`` says minimise the output error (the optimal brain surgeon update, done with
the upper Cholesky factor ``U`` of ``H⁻¹``):

    err[n]       = (W[n, k] − Ŵ[n, k]) / U[k, k]
    W[n, k+1:]  −= err[n] · U[k, k+1:]

Rows are independent (each output channel has its own error), so this is exact per row.

**The stored format is unchanged.** Every row keeps the scale round-to-nearest would give it,
``max_k |W[n, k]| / Q``, and the element that set it is forced to the full code ``±Q`` when its
column comes (the error feedback may have moved it); its error is fed forward like any other. So
a calibrated weight written back in float32 (:func:`gptq_round` returns ``scale · q``) quantizes
with plain round-to-nearest, at any TP degree and on load or in the shard writer alike, back to
exactly the codes chosen here: the scale comes out the same (to an ulp, which moves no code), and
each value is a code times it.

``H`` gets a damping of ``damp · mean(diag H)`` on its diagonal (inputs that never vary make it
singular); a column whose input was always zero is left to round-to-nearest.
"""

from __future__ import annotations

import torch

from services.modeling.quant import QuantScheme, channel_scales

DEFAULT_BLOCK = 128
DEFAULT_DAMP = 0.01


def _codes(column: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round-to-nearest codes of one column [N] (float64 in, float64 codes out)."""
    scaled = (column / scale).clamp(-scheme.qmax, scheme.qmax)
    if scheme.weight_dtype == torch.int8:
        return scaled.round()
    return scaled.float().to(scheme.weight_dtype).double()


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, scheme: QuantScheme, *,
               block: int = DEFAULT_BLOCK, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """``weight`` [N, K] calibrated onto ``scheme``'s grid with input Hessian ``hessian`` [K, K];
    returns ``scale[n] · q[n, k]`` in float32 (see the module docstring)."""
    n_rows, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, weight has {k} input columns")
    original = weight.double()
    scale = channel_scales(weight, scheme).double()
    work = original.clone()
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    work[:, dead] = 0.0
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    # the element of each row that sets its scale, and the full code it must keep
    top = original.abs().argmax(dim=1)
    top_code = torch.sign(original[torch.arange(n_rows), top]) * scheme.qmax
    codes = torch.zeros_like(work)
    for start in range(0, k, block):
        stop = min(start + block, k)
        w = work[:, start:stop].clone()
        errors = torch.zeros_like(w)
        u = upper[start:stop, start:stop]
        for i in range(stop - start):
            col = start + i
            if dead[col]:  # no input ever reached it: its error costs nothing, feed none forward
                codes[:, col] = torch.where(top == col, top_code, _codes(original[:, col], scale, scheme))
                continue
            q = torch.where(top == col, top_code, _codes(w[:, i], scale, scheme))
            codes[:, col] = q
            err = (w[:, i] - q * scale) / u[i, i]
            w[:, i:] -= err.unsqueeze(1) * u[i, i:].unsqueeze(0)
            errors[:, i] = err
        work[:, stop:] -= errors @ upper[start:stop, stop:]
    return (codes * scale.unsqueeze(1)).float()


class HessianAccumulator:
    """``2 XᵀX / T`` of the inputs a linear layer saw, accumulated over calibration batches."""

    def __init__(self, in_features: int) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1]).double()
        self.sum += flat.T @ flat
        self.rows += flat.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.rows == 0:
            raise ValueError("no calibration inputs were seen")
        return 2.0 * self.sum / self.rows
