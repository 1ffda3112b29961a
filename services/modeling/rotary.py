"""Rotary position embeddings (RoPE), with Llama-3's frequency scaling.

``inv_freq_j = θ^(-2j/d)``; a token at position ``m`` rotates each pair ``(x_j, x_{j+d/2})`` by
``m · inv_freq_j``. Llama-3 (`rope_scaling.rope_type == "llama3"`) divides the low frequencies
(wavelength above ``original_max_position_embeddings / low_freq_factor``) by ``factor``, keeps the
high ones, and interpolates smoothly between. The arithmetic follows the reference implementation
step for step (float32, the same operation order) so that outputs match it to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """Precomputed float32 cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, *,
                 scaling: dict[str, Any] | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width cos/sin rows for ``positions``, [tokens, 1, d/2]: computed once per step and
        shared by every layer (the two halves of the reference's tables are equal)."""
        # (a step being captured into a CUDA graph may not read a value back: its positions were
        # checked on the host)
        if not _capturing(positions) and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} is beyond max_position_embeddings="
                             f"{self.cos.shape[0]}")
        half = self.cos.shape[-1] // 2
        cos = self.cos[positions, :half].unsqueeze(1).to(dtype)
        sin = self.sin[positions, :half].unsqueeze(1).to(dtype)
        return cos, sin


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
