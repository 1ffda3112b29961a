"""ModelConfig: the shape of a Llama-family checkpoint, read from its HF ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.dtypes import DENSE_DTYPES, canonical_dtype

# The dense dtypes a model can run in, as torch spells them (names from services.common.dtypes).
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DENSE_DTYPES}


# config.json key `shardline quantize` writes: which scheme a calibrated copy's weights were rounded for
CALIBRATION_KEY = "shardline_calibration"


class ModelConfigError(ValueError):
    """The checkpoint's config cannot be served as asked (bad shape, unsupported field, bad split)."""


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[canonical_dtype(name, DENSE_DTYPES, error=ModelConfigError)]


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Llama ``config.json`` that the model and the KV cache need."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    name: str = "llama"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for attr in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "head_dim"):
            if getattr(self, attr) < 1:
                raise ModelConfigError(f"{attr} must be >= 1, got {getattr(self, attr)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ("llama3", "default", "linear"):
                raise ModelConfigError(f"rope_scaling type {rope_type!r} is not supported "
                                       "(supported: llama3, linear, default)")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], *, name: str = "llama") -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if cfg.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in archs:
            raise ModelConfigError(f"model_type {cfg.get('model_type')!r} / architectures {archs} "
                                   "is not a Llama-family decoder")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ModelConfigError("attention_bias/mlp_bias checkpoints are not supported")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            vocab_size=int(cfg["vocab_size"]),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=canonical_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "float32", DENSE_DTYPES,
                                        error=ModelConfigError),
            name=name,
            raw=dict(cfg),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise ModelConfigError(f"{path} not found: expected a Hugging Face model directory")
        return cls.from_dict(json.loads(path.read_text()), name=Path(model_dir).resolve().name)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Unsharded KV bytes per token: 2 (K and V) · layers · kv_heads · head_dim · dtype bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
