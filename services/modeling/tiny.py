"""A tiny random Llama in Hugging Face layout, for tests and demos.

`write_tiny_model(TinyModelSpec(...), out_dir)` writes config.json, model.safetensors,
generation_config.json, tokenizer.json and tokenizer_config.json. Weights come from a seeded
`torch.Generator`, so one spec always gives byte-identical files. The default shape divides by
TP 1/2/4 (heads 8, KV heads 4, intermediate 512, vocab 512) and PP 1/2/4 (4 layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.common.dtypes import DENSE_DTYPES, canonical_dtype
from services.modeling.config import TORCH_DTYPES, ModelConfigError
from services.modeling.hf_tokenizer import (
    MIN_BYTE_LEVEL_VOCAB,
    TINY_CHAT_TEMPLATE,
    byte_level_tokenizer,
    write_json,
    write_tokenizer_files,
)

ROPE_SCALING_TYPES = ("llama3",)

# Std of every linear/embedding weight: transformers' LlamaConfig.initializer_range.
WEIGHT_STD = 0.02
# RMSNorm gains are 1 + N(0, NORM_NOISE): near identity, but a loader that forgot to copy them
# (leaving ones) would show up in a parity test.
NORM_NOISE = 0.05


class TinyModelSpecError(ValueError):
    """A tiny-model shape that cannot make a valid Llama."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape, seed and storage dtype of a tiny random Llama."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 512
    vocab: int = 512
    max_position: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 0
    dtype: str = "float32"
    tie_embeddings: bool = False
    rope_scaling: str | None = None
    # llama3 scaling's pre-extension context; defaults to max_position // 4 (must be below
    # max_position, as transformers checks). With the default shape that puts rotary frequencies
    # in all three llama3 bands: kept, blended and divided by the factor.
    rope_original_max_position: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_position"):
            value = getattr(self, name)
            if value < 1:
                raise TinyModelSpecError(f"{name} must be >= 1, got {value}")
        if self.hidden % self.heads:
            raise TinyModelSpecError(
                f"hidden ({self.hidden}) must be divisible by heads ({self.heads}); "
                f"remainder {self.hidden % self.heads}"
            )
        if (self.hidden // self.heads) % 2:
            raise TinyModelSpecError(
                f"head_dim = hidden/heads = {self.hidden // self.heads} must be even for rotary embeddings"
            )
        if self.heads % self.kv_heads:
            raise TinyModelSpecError(
                f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads}) for grouped-query attention"
            )
        if self.vocab < MIN_BYTE_LEVEL_VOCAB:
            raise TinyModelSpecError(
                f"vocab must be >= {MIN_BYTE_LEVEL_VOCAB} (4 special + 256 byte tokens), got {self.vocab}"
            )
        if self.rope_theta <= 0:
            raise TinyModelSpecError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise TinyModelSpecError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_scaling is not None and self.rope_scaling not in ROPE_SCALING_TYPES:
            raise TinyModelSpecError(
                f"rope_scaling must be one of {ROPE_SCALING_TYPES} or None, got {self.rope_scaling!r}"
            )
        original = self.rope_original_max_position
        if original is not None and not 1 <= original < self.max_position:
            raise TinyModelSpecError(
                f"rope_original_max_position must be in [1, max_position={self.max_position}), got {original}"
            )
        # Normalise aliases so the written config always uses canonical names.
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, DENSE_DTYPES, error=ModelConfigError))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    def hf_config(self) -> dict[str, object]:
        """config.json as transformers' LlamaConfig reads it."""
        config: dict[str, object] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": WEIGHT_STD,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 3,
            "torch_dtype": self.dtype,
            "rope_scaling": self.rope_scaling_config(),
        }
        return config

    def rope_scaling_config(self) -> dict[str, object] | None:
        if self.rope_scaling is None:
            return None
        # Llama-3.1's published factors; the original context is ours to choose for a tiny model.
        return {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": self.rope_original_max_position or max(1, self.max_position // 4),
        }

    def n_parameters(self) -> int:
        embed = self.vocab * self.hidden
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attn + mlp + 2 * self.hidden
        lm_head = 0 if self.tie_embeddings else embed
        return embed + self.layers * per_layer + self.hidden + lm_head


def random_weights(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """HF-named tensors drawn in a fixed order from one seeded generator.

    Drawn in float32 and then cast, so the float32 and bfloat16 models share the same values
    up to rounding (a bf16-vs-fp32 comparison then measures precision, not different weights).
    """
    generator = torch.Generator(device="cpu").manual_seed(spec.seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=generator) * WEIGHT_STD

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(spec.hidden, generator=generator) * NORM_NOISE

    q_out = spec.heads * spec.head_dim
    kv_out = spec.kv_heads * spec.head_dim
    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": linear(spec.vocab, spec.hidden)}
    for i in range(spec.layers):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.input_layernorm.weight"] = norm()
        weights[f"{prefix}.self_attn.q_proj.weight"] = linear(q_out, spec.hidden)
        weights[f"{prefix}.self_attn.k_proj.weight"] = linear(kv_out, spec.hidden)
        weights[f"{prefix}.self_attn.v_proj.weight"] = linear(kv_out, spec.hidden)
        weights[f"{prefix}.self_attn.o_proj.weight"] = linear(spec.hidden, q_out)
        weights[f"{prefix}.post_attention_layernorm.weight"] = norm()
        weights[f"{prefix}.mlp.gate_proj.weight"] = linear(spec.intermediate, spec.hidden)
        weights[f"{prefix}.mlp.up_proj.weight"] = linear(spec.intermediate, spec.hidden)
        weights[f"{prefix}.mlp.down_proj.weight"] = linear(spec.hidden, spec.intermediate)
    weights["model.norm.weight"] = norm()
    if not spec.tie_embeddings:
        weights["lm_head.weight"] = linear(spec.vocab, spec.hidden)
    return {name: tensor.to(spec.torch_dtype).contiguous() for name, tensor in weights.items()}


@dataclass(frozen=True)
class WrittenModel:
    """What a model writer produced: where, which shape, how many bytes."""

    out_dir: Path
    config: dict[str, object]
    files: tuple[Path, ...]

    @property
    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)

    def summary(self) -> str:
        c = self.config
        tied = "tied" if c["tie_word_embeddings"] else "untied"
        return (
            f"wrote {self.out_dir}: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
            f"{c['num_attention_heads']} heads, {c['num_key_value_heads']} kv heads, "
            f"head_dim {c['head_dim']}, intermediate {c['intermediate_size']}, vocab {c['vocab_size']}, "
            f"{tied} embeddings, {c['torch_dtype']}; {len(self.files)} files, {self.total_bytes:,} bytes"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "out_dir": str(self.out_dir),
            "files": [path.name for path in self.files],
            "bytes": self.total_bytes,
            "config": self.config,
        }


def write_tiny_model(spec: TinyModelSpec, out_dir: Path) -> WrittenModel:
    """Write the tiny model's HF directory (created if missing; existing files overwritten)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = spec.hf_config()
    config_path = out_dir / "config.json"
    write_json(config_path, config)

    weights_path = out_dir / "model.safetensors"
    save_file(random_weights(spec), str(weights_path), metadata={"format": "pt"})

    generation_path = out_dir / "generation_config.json"
    write_json(
        generation_path,
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
         "pad_token_id": config["pad_token_id"]},
    )

    tokenizer, special = byte_level_tokenizer(spec.vocab)
    tokenizer_paths = write_tokenizer_files(
        out_dir, tokenizer, special, chat_template=TINY_CHAT_TEMPLATE, model_max_length=spec.max_position
    )
    files = (config_path, weights_path, generation_path, *tokenizer_paths)
    return WrittenModel(out_dir=out_dir, config=config, files=files)
