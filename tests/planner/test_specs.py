"""Model shapes: parameter counts from the shape, KV bytes per token, dtypes, config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.dtypes import canonical_dtype
from services.planner.specs import DTYPES, PRESETS, ModelSpec, SpecError, load_model_spec, parse_dtypes


def test_llama3_70b_parameters_are_computed_from_the_shape() -> None:
    m = PRESETS["llama3-70b"]
    # 2 · 128256 · 8192 (embedding + untied lm_head) + 80 · 855,654,400 + 8192 (final norm)
    assert m.params_per_layer == 855_654_400
    assert m.num_parameters == 2 * 128256 * 8192 + 80 * 855_654_400 + 8192 == 70_553_706_496
    assert abs(m.num_parameters - 70.55e9) < 0.01e9


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("llama3-8b", 8_030_261_248),  # the published 8.03B
        ("llama3.1-405b", 405_853_388_800),  # the published 405.85B
        ("smollm2-135m", 134_515_008),  # tied embeddings: counted once
    ],
)
def test_other_presets_match_published_counts(preset: str, expected: int) -> None:
    assert PRESETS[preset].num_parameters == expected


def test_kv_bytes_per_token_unsharded() -> None:
    m = PRESETS["llama3-70b"]
    assert m.kv_bytes_per_token("fp16") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert m.kv_bytes_per_token("float32") == 655_360
    # Weight-only quantization keeps a 16-bit KV cache.
    assert m.kv_bytes_per_token("int8") == m.kv_bytes_per_token("fp8") == 327_680


def test_weight_bytes_per_dtype() -> None:
    m = PRESETS["llama3-70b"]
    assert m.weight_bytes("float16") == 2 * m.num_parameters
    assert m.weight_bytes("bfloat16") == 2 * m.num_parameters
    assert m.weight_bytes("float32") == 4 * m.num_parameters
    linear = 80 * (m.attention_params_per_layer + m.mlp_params_per_layer) + m.lm_head_params
    rest = m.num_parameters - linear
    out_channels = 80 * (8192 + 2 * 1024 + 8192 + 2 * 28672 + 8192) + m.vocab_size
    # int8/fp8: 1 byte per linear weight (the lm_head's too) + a float32 scale per output channel;
    # the untied embedding and the norms stay 16-bit.
    for dtype in ("int8", "fp8"):
        assert m.weight_bytes(dtype) == linear + 4 * out_channels + 2 * rest


def test_tiny_preset_is_the_model_tiny_default_shape() -> None:
    t = PRESETS["tiny"]
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads) == (4, 256, 8, 4)
    assert (t.intermediate_size, t.vocab_size, t.head_dim, t.tie_word_embeddings) == (512, 512, 32, False)


def test_dtype_aliases_and_errors() -> None:
    assert canonical_dtype("fp16") == "float16"
    assert canonical_dtype("BF16") == "bfloat16"
    assert canonical_dtype("fp32") == "float32"
    assert parse_dtypes("any") == tuple(DTYPES)
    assert parse_dtypes("fp16,int8,float16") == ("float16", "int8")
    with pytest.raises(SpecError, match=r"unknown dtype 'fp4': expected one of \['bfloat16', 'float16'"):
        parse_dtypes("fp4")


def _hf_config(m: ModelSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.intermediate_size,
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_word_embeddings,
        "rope_theta": 100000.0,
    }


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_config_json_gives_the_same_shape_as_the_preset(tmp_path: Path, preset: str) -> None:
    m = PRESETS[preset]
    model_dir = tmp_path / preset
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(_hf_config(m)))
    for source in (model_dir, model_dir / "config.json"):
        loaded = load_model_spec(str(source))
        assert loaded.num_parameters == m.num_parameters
        assert loaded.kv_bytes_per_token() == m.kv_bytes_per_token()
        assert loaded.name == preset


def test_config_json_without_head_dim_or_kv_heads_uses_llama_defaults() -> None:
    spec = ModelSpec.from_hf_config(
        {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
         "vocab_size": 100},
        name="mha",
    )
    assert spec.head_dim == 16 and spec.num_key_value_heads == 4 and not spec.tie_word_embeddings


def test_bad_shapes_are_rejected_with_the_numbers() -> None:
    with pytest.raises(SpecError, match="num_attention_heads 8 must be a multiple of num_key_value_heads 3"):
        ModelSpec("x", num_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=3,
                  intermediate_size=128, vocab_size=10)
    with pytest.raises(SpecError, match="num_layers must be a positive integer, got 0"):
        ModelSpec("x", num_layers=0, hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
                  intermediate_size=128, vocab_size=10)
    with pytest.raises(SpecError, match="missing intermediate_size"):
        ModelSpec.from_hf_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                  "vocab_size": 10})
    with pytest.raises(SpecError, match="mixture-of-experts"):
        ModelSpec.from_hf_config({"num_local_experts": 8})
    with pytest.raises(SpecError, match="unknown model 'llama9'"):
        load_model_spec("llama9")
