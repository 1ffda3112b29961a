"""The decoder layer's dense segments as plain tensor functions, optionally compiled.

A decode step on CPU is a few large matmuls and ~40 small element-wise ops per layer; at batch 1
the small ops' dispatch costs as much as a quarter of the step. Between two communication points
a layer is pure tensor math, so it is written here as two functions:

- :func:`attention_input`: RMSNorm → fused q/k/v projection → rotary on q and k;
- :func:`mlp_input`: residual add of the (all-reduced) attention output → RMSNorm → fused
  gate/up projection → SiLU · up.

Attention (the paged KV cache), ``o_proj`` and ``down_proj`` (each followed by the coordinator's
all-reduce) stay eager between them, so the coordinator still sees and times every collective.

:class:`SegmentCompiler` wraps both with ``torch.compile`` (inductor generates one C++ kernel for
each run of element-wise ops; the matmuls stay oneDNN/BLAS calls). Shapes are static: the token
count is padded up to a bucket (1, 2, 4, … 256), so a serving run compiles at most one graph per
bucket and never recompiles per step; larger (prefill) batches run eager, where the matmuls
dominate anyway. Like vLLM's ``compilation_config``, compiling is a start-up choice
(``--compile``); eager and compiled runs compute the same function up to float rounding.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
import torch.nn.functional as F

from services.worker.models.rotary import apply_rotary

COMPILE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w · x / sqrt(mean(x²) + ε)``: statistics in float32, cast back, then scaled (the
    reference's order of operations)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def attention_input(h: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, eps: float, heads: int,
                    kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``h`` [tokens, hidden] → rotated q [tokens, heads, d], rotated k and v [tokens, kv_heads, d]."""
    qkv = F.linear(rms_norm(h, norm_weight, eps), qkv_weight)
    qkv = qkv.view(h.shape[0], heads + 2 * kv_heads, -1)
    qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)  # q and k rotated in one pass
    return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]


def mlp_input(h: torch.Tensor, attn_out: torch.Tensor, norm_weight: torch.Tensor,
              gate_up_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add, then the MLP up to ``down_proj``: (new residual stream, silu(gate) · up)."""
    h = h + attn_out
    gate, up = F.linear(rms_norm(h, norm_weight, eps), gate_up_weight).chunk(2, dim=-1)
    return h, F.silu(gate) * up


class Segments(Protocol):
    def attention_input(self, h, norm_weight, qkv_weight, cos, sin, eps, heads, kv_heads): ...
    def mlp_input(self, h, attn_out, norm_weight, gate_up_weight, eps): ...


class _Eager:
    attention_input = staticmethod(attention_input)
    mlp_input = staticmethod(mlp_input)


EAGER: Segments = _Eager()


def bucket_for(tokens: int) -> int | None:
    """The smallest compile bucket holding ``tokens``; None above the largest (run eager)."""
    for size in COMPILE_BUCKETS:
        if tokens <= size:
            return size
    return None


class SegmentCompiler:
    """Runs the two segments compiled at bucketed token counts, eager otherwise.

    One instance per model (one per rank process). Padding rows are zeros: every op in the
    segments is row-wise, so padded rows never touch real ones and are sliced off."""

    def __init__(self) -> None:
        import torch._dynamo

        # one graph per (segment, bucket); the default cache limit (8) would fall back to eager
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    2 * len(COMPILE_BUCKETS))
        self._attention_input = torch.compile(attention_input, dynamic=False, fullgraph=True)
        self._mlp_input = torch.compile(mlp_input, dynamic=False, fullgraph=True)
        self._lock = threading.Lock()  # compiling is not thread-safe; serving runs one step at a time

    def attention_input(self, h, norm_weight, qkv_weight, cos, sin, eps, heads, kv_heads):
        n = h.shape[0]
        size = bucket_for(n)
        if size is None:
            return attention_input(h, norm_weight, qkv_weight, cos, sin, eps, heads, kv_heads)
        with self._lock:
            q, k, v = self._attention_input(_pad(h, size), norm_weight, qkv_weight, _pad(cos, size),
                                            _pad(sin, size), eps, heads, kv_heads)
        return q[:n], k[:n], v[:n]

    def mlp_input(self, h, attn_out, norm_weight, gate_up_weight, eps):
        n = h.shape[0]
        size = bucket_for(n)
        if size is None:
            return mlp_input(h, attn_out, norm_weight, gate_up_weight, eps)
        with self._lock:
            h2, act = self._mlp_input(_pad(h, size), _pad(attn_out, size), norm_weight, gate_up_weight, eps)
        return h2[:n], act[:n]

    def warm_up(self, norm_weight: torch.Tensor, qkv_weight: torch.Tensor, gate_up_weight: torch.Tensor, *,
                heads: int, kv_heads: int, eps: float, buckets=COMPILE_BUCKETS) -> None:
        """Compile every bucket now (at start-up) instead of at the first step of each size.
        The graphs take weights as inputs, so one layer's parameters serve for all (the guards
        check shapes, dtypes and types — pass the real ``Parameter`` objects)."""
        hidden = qkv_weight.shape[1]
        head_dim = qkv_weight.shape[0] // (heads + 2 * kv_heads)
        like = dict(dtype=qkv_weight.dtype, device=qkv_weight.device)
        with torch.inference_mode():
            for size in buckets:
                h = torch.zeros(size, hidden, **like)
                cos, sin = (torch.zeros(size, 1, head_dim // 2, **like) for _ in range(2))  # distinct: guards check aliasing
                self.attention_input(h, norm_weight, qkv_weight, cos, sin, eps, heads, kv_heads)
                self.mlp_input(h, torch.zeros_like(h), norm_weight, gate_up_weight, eps)


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    out = x.new_zeros((rows, *x.shape[1:]))
    out[:x.shape[0]] = x
    return out
