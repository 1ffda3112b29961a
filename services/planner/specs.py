"""Model shapes and dtypes: what the planner needs to know about a dense Llama-family decoder.

A :class:`ModelSpec` is the architecture only (no weights). Parameter counts are computed from
the shape, never looked up, so a new config.json is planned exactly like a preset:

    embedding        = vocab · hidden
    lm_head          = vocab · hidden                (0 when tie_word_embeddings)
    per layer        = attention + mlp + 2 · hidden  (input and post-attention RMSNorm)
      attention      = hidden · heads · head_dim     (q_proj)
                     + 2 · hidden · kv_heads · head_dim   (k_proj, v_proj; GQA)
                     + heads · head_dim · hidden     (o_proj)
      mlp            = 3 · hidden · intermediate     (gate_proj, up_proj, down_proj)
    final norm       = hidden
    total            = embedding + lm_head + layers · per layer + final norm

For the Llama-3-70B shape that is 70,553,706,496 ≈ 70.55e9.

KV cache per token, unsharded: ``2 · layers · kv_heads · head_dim · kv_bytes`` (K and V).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from services.common.dtypes import DTYPE_ALIASES, DTYPES, DType, canonical_dtype
from services.common.errors import InvalidArgument, NotFound


class SpecError(InvalidArgument):
    """A model shape or dtype is unknown or inconsistent (a ValueError; INVALID_ARGUMENT over gRPC)."""


class UnknownModelError(NotFound, SpecError):
    """No preset, config.json or model directory by that name (NOT_FOUND over gRPC)."""


# --------------------------------------------------------------------------------------------
# dtypes


def get_dtype(name: str) -> DType:
    return DTYPES[canonical_dtype(name, error=SpecError)]


def parse_dtypes(value: str) -> tuple[str, ...]:
    """``any`` → every dtype; otherwise a comma-separated list of names or aliases."""
    if value.strip().lower() == "any":
        return tuple(DTYPES)
    names: list[str] = []
    for part in value.split(","):
        if part.strip():
            name = canonical_dtype(part, error=SpecError)
            if name not in names:
                names.append(name)
    if not names:
        raise SpecError(f"no dtype in {value!r}; expected a dtype name or 'any'")
    return tuple(names)


# --------------------------------------------------------------------------------------------
# model shape


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a dense decoder-only Llama-family transformer."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None  # None → hidden_size / num_attention_heads
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"{self.name}: {name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise SpecError(
                    f"{self.name}: hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}; give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        elif not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise SpecError(f"{self.name}: head_dim must be a positive integer, got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecError(
                f"{self.name}: num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads} (grouped-query attention)"
            )

    # ---- parameter counts ------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        """Output width of q_proj: heads · head_dim."""
        return self.num_attention_heads * self.head_dim  # type: ignore[operator]

    @property
    def kv_size(self) -> int:
        """Output width of k_proj (and of v_proj): kv_heads · head_dim."""
        return self.num_key_value_heads * self.head_dim  # type: ignore[operator]

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        params = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            params += self.q_size + 2 * self.kv_size
        return params

    @property
    def mlp_params_per_layer(self) -> int:
        params = 3 * self.hidden_size * self.intermediate_size
        if self.mlp_bias:
            params += 2 * self.intermediate_size + self.hidden_size
        return params

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size

    @property
    def params_per_layer(self) -> int:
        return self.attention_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer

    @property
    def num_parameters(self) -> int:
        """Total parameters; a tied lm_head is counted once (it is the embedding)."""
        return (
            self.embedding_params
            + self.lm_head_params
            + self.num_layers * self.params_per_layer
            + self.hidden_size  # final norm
        )

    # ---- memory ----------------------------------------------------------------------------

    def kv_bytes_per_token(self, dtype: str | DType = "float16") -> int:
        """Unsharded KV cache per token: 2 · layers · kv_heads · head_dim · bytes."""
        d = dtype if isinstance(dtype, DType) else get_dtype(dtype)
        return 2 * self.num_layers * self.kv_size * d.activation_bytes

    def weight_bytes(self, dtype: str | DType = "float16") -> int:
        """Unsharded weight bytes: decoder linears and the lm_head at ``weight_bytes`` (+ one
        scale per output channel, for a quantized dtype); a tied embedding is the lm_head's table,
        an untied one and the norms are at the activation dtype."""
        d = dtype if isinstance(dtype, DType) else get_dtype(dtype)
        linear = self.num_layers * (self.attention_params_per_layer + self.mlp_params_per_layer)
        out_channels = self.num_layers * (
            self.q_size + 2 * self.kv_size + self.hidden_size + 2 * self.intermediate_size + self.hidden_size
        )
        table = self.vocab_size * self.hidden_size
        quantized_table = table * d.weight_bytes + self.vocab_size * d.scale_bytes  # the lm_head
        dense = self.num_parameters - linear - table - self.lm_head_params  # norms (and biases)
        untied_embedding = 0 if self.tie_word_embeddings else table * d.activation_bytes
        return (linear * d.weight_bytes + out_channels * d.scale_bytes + quantized_table + untied_embedding
                + dense * d.activation_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, name: str | None = None) -> ModelSpec:
        """Build from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2-style dense)."""
        if config.get("num_local_experts") or config.get("n_routed_experts"):
            raise SpecError("mixture-of-experts configs are not supported: shardline plans dense decoders")
        required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                    "vocab_size")
        missing = [key for key in required if key not in config]
        if missing:
            raise SpecError(f"config.json is missing {', '.join(missing)}; expected a Llama-style config")
        model_name = name or config.get("_name_or_path") or (config.get("architectures") or ["model"])[0]
        return cls(
            name=str(model_name),
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )

    @classmethod
    def from_config_file(cls, path: str | Path) -> ModelSpec:
        """Read ``config.json`` (or a model directory containing one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise SpecError(f"no config.json at {p}")
        try:
            config = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise SpecError(f"{p} is not valid JSON: {exc}") from exc
        name = p.parent.name if p.name == "config.json" else p.stem
        return cls.from_hf_config(config, name=name or None)


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("llama3-70b", num_layers=80, hidden_size=8192, num_attention_heads=64,
                  num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256),
        ModelSpec("llama3-8b", num_layers=32, hidden_size=4096, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256),
        ModelSpec("llama3.1-405b", num_layers=126, hidden_size=16384, num_attention_heads=128,
                  num_key_value_heads=8, head_dim=128, intermediate_size=53248, vocab_size=128256),
        ModelSpec("smollm2-135m", num_layers=30, hidden_size=576, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                  tie_word_embeddings=True),
        # The `shardline model tiny` default shape: TP 1/2/4 and PP 1/2/4 divide it (tests run them all).
        ModelSpec("tiny", num_layers=4, hidden_size=256, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=512, vocab_size=512),
    )
}


def load_model_spec(model: str) -> ModelSpec:
    """A preset name, a config.json path, or a model directory containing config.json."""
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.exists():
        return ModelSpec.from_config_file(path)
    raise UnknownModelError(
        f"unknown model {model!r}: expected a preset ({', '.join(PRESETS)}), a config.json or a "
        "model directory"
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "DTYPES",
    "DTYPE_ALIASES",
    "DType",
    "ModelSpec",
    "PRESETS",
    "SpecError",
    "UnknownModelError",
    "ceil_div",
    "get_dtype",
    "load_model_spec",
    "parse_dtypes",
]
