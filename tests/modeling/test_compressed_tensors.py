"""Checkpoints in the compressed-tensors format (llm-compressor's): a plan of the checkpoint's own
scheme holds exactly its codes and scales at every TP degree, a dense plan their values, and the
schemes this loader does not take are refused with what they are (tiny random Llama, written here
the way llm-compressor writes them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.cli import main
from services.modeling.compressed_tensors import CompressedTensorsError, compressed_format
from services.modeling.config import ModelConfig, ModelConfigError
from services.modeling.parallel.plan import ParallelPlan
from services.modeling.quant import FP8, INT8, SCHEMES, quantize
from services.modeling.tiny import write_tiny_model
from services.modeling.weights import CheckpointReader
from tests.modeling.test_quant_model import TP3_SPEC, loaded, logits, raw_bytes, tp3_shares

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMAT = {"fp8": ("float-quantized", "float"), "int8": ("int-quantized", "int")}


def quantization_config(dtype: str, **weights) -> dict:
    fmt, kind = FORMAT[dtype]
    group = {"format": fmt, "targets": ["Linear"], "output_activations": None,
             "weights": {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True, "dynamic": False,
                         **weights},
             "input_activations": {"num_bits": 8, "type": kind, "strategy": "token", "symmetric": True,
                                   "dynamic": True}}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "sparsity_config": {}}


def llm_compressor_codes(weight: torch.Tensor, dtype: str, ours: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and [N, 1] scales: our own rounding, or llm-compressor's (int8: max|W| / 127.5, so a
    row's most negative value may take the code -128)."""
    if ours or dtype == "fp8":
        q, s = quantize(weight, SCHEMES[dtype])
        return q, s.unsqueeze(1)
    s = weight.float().abs().amax(dim=1, keepdim=True) / 127.5
    return (weight.float() / s).round_().clamp_(-128, 127).to(torch.int8), s


def write_compressed(src: Path, out: Path, dtype: str, *, ours: bool = False) -> dict[str, tuple]:
    """``src``'s checkpoint with every decoder linear weight as codes and scales; returns them."""
    shutil.copytree(src, out)
    tensors, written = {}, {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            if name.endswith(tuple(f"{p}.weight" for p in LINEARS)):
                q, s = llm_compressor_codes(tensor, dtype, ours)
                tensors[name], tensors[name.removesuffix(".weight") + ".weight_scale"] = q, s
                written[name] = (q, s.squeeze(1))
            else:
                tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(dtype)
    (out / "config.json").write_text(json.dumps(config))
    return written


@pytest.fixture(scope="module")
def tiny_tp3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp3") / "model"
    write_tiny_model(TP3_SPEC, out)
    return out


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_a_plan_of_the_checkpoints_scheme_holds_its_codes_and_scales_at_tp1_and_tp3(tiny_tp3, tmp_path, dtype):
    written = write_compressed(tiny_tp3, tmp_path / "ct", dtype)
    if dtype == "int8":  # llm-compressor's grid, not ours: rounding scale·code again would move it
        assert any((q == -128).any() for q, _ in written.values())
    cfg = ModelConfig.from_dir(tmp_path / "ct")
    for tp in (1, 3):
        for rank in range(tp):
            params = dict(loaded(tmp_path / "ct", ParallelPlan(cfg, tp, 1, dtype), rank).named_parameters())
            for layer in range(cfg.num_hidden_layers):
                pre = f"model.layers.{layer}"
                for param, (want_q, want_s) in tp3_shares(written, pre, rank, tp).items():
                    got_q, got_s = params[f"{pre}.{param}.weight"], params[f"{pre}.{param}.weight_scale"]
                    assert got_q.dtype == SCHEMES[dtype].weight_dtype
                    assert torch.equal(raw_bytes(got_q), raw_bytes(want_q)), f"tp{tp} rank {rank} {param}"
                    assert torch.equal(got_s, want_s), f"tp{tp} rank {rank} {param} scales"


def test_a_dense_plan_holds_the_checkpoints_values(tiny_tp3, tmp_path):
    written = write_compressed(tiny_tp3, tmp_path / "ct", "int8")
    params = dict(loaded(tmp_path / "ct", ParallelPlan(ModelConfig.from_dir(tmp_path / "ct"), 1, 1, "float32"))
                  .named_parameters())
    q, s = written["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(params["model.layers.1.mlp.down_proj.weight"], q.float() * s.unsqueeze(1))


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_our_own_codes_as_a_compressed_checkpoint_give_the_same_logits(tiny_tp3, tmp_path, dtype):
    """The original served as ``dtype`` (quantized on load) and its codes written as a
    compressed-tensors checkpoint served as ``dtype``: the same numbers, the same logits, bit for bit."""
    write_compressed(tiny_tp3, tmp_path / "ct", dtype, ours=True)
    cfg = ModelConfig.from_dir(tiny_tp3)
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    # the checkpoint leaves lm_head dense (ignore: lm_head); the original's plan does too
    original = logits(loaded(tiny_tp3, ParallelPlan(cfg, 1, 1, dtype, quantize_lm_head=False)), ids)
    compressed = logits(loaded(tmp_path / "ct", ParallelPlan(ModelConfig.from_dir(tmp_path / "ct"), 1, 1, dtype,
                                                             quantize_lm_head=False)), ids)
    assert torch.equal(original, compressed)


def test_the_scales_travel_with_their_weights(tiny_tp3, tmp_path):
    write_compressed(tiny_tp3, tmp_path / "ct", "fp8")
    with CheckpointReader(tmp_path / "ct") as reader:
        assert reader.compressed is not None and reader.compressed.scheme is FP8
        assert not [n for n in reader.names() if n.endswith("_scale")]
        piece = reader.get_slice("model.layers.0.mlp.down_proj.weight")[:, 10:20]
        assert piece.codes.shape == (192, 10) and piece.scale.shape == (192,) and piece.scale.dtype == torch.float32


def test_a_plan_of_the_other_scheme_is_refused(tiny_tp3, tmp_path):
    write_compressed(tiny_tp3, tmp_path / "ct", "fp8")
    cfg = ModelConfig.from_dir(tmp_path / "ct")
    with pytest.raises(ModelConfigError, match="serve them as fp8, or dense"):
        ParallelPlan(cfg, 1, 1, "int8")
    assert ParallelPlan(cfg, 1, 1, "bfloat16").weight_quant is None
    # the checkpoint left its lm_head dense (ignore: lm_head): so does a plan that does not say
    assert ParallelPlan(cfg, 1, 1, "fp8").lm_head_quant is None
    assert ParallelPlan(cfg, 1, 1, "fp8", quantize_lm_head=True).lm_head_quant is FP8
    assert ParallelPlan(ModelConfig.from_dir(tiny_tp3), 1, 1, "fp8").lm_head_quant is FP8


@pytest.mark.parametrize("change, refusal", [
    ({"strategy": "group", "group_size": 128}, "group-wise"),
    ({"symmetric": False}, "symmetric=False"),
    ({"num_bits": 4}, "4-bit int weights"),
])
def test_schemes_not_ours_are_refused_with_what_they_are(change, refusal):
    with pytest.raises(CompressedTensorsError, match=refusal):
        compressed_format({"quantization_config": quantization_config("int8", **change)})
    static = quantization_config("fp8")
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(CompressedTensorsError, match="static activation scales"):
        compressed_format({"quantization_config": static})
    assert compressed_format({"quantization_config": {"quant_method": "gptq"}}) is None
    described = compressed_format({"quantization_config": quantization_config("int8")})
    assert described.scheme is INT8 and "int8 per token, dynamic" in described.describe()


def test_shardline_quantize_refuses_an_already_quantized_checkpoint(tiny_tp3, tmp_path, capsys):
    write_compressed(tiny_tp3, tmp_path / "ct", "int8")
    assert main(["quantize", "--model", str(tmp_path / "ct"), "--out", str(tmp_path / "out"), "--dtype", "int8"]) == 2
    assert "already quantized (compressed-tensors int8" in capsys.readouterr().err
