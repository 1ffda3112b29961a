"""Pre-sharded int8/fp8 checkpoints: the writer stores each linear weight quantized with its
float32 per-output-channel scales; the manifest and every header record the scheme; a worker
loads the very values it would get quantizing the HF directory itself; and every mismatch is
refused before any weight is used, naming what was expected and what was found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from services.cli import main as cli_main
from services.loader.errors import ShardLayoutError
from services.loader.layout import rank_model
from services.loader.safetensors_format import read_header
from services.modeling.config import ModelConfig
from services.modeling.parallel.plan import ParallelPlan
from services.worker.rank_loading import load_checkpoint_weights, plan_for_checkpoint
from tests.loader.conftest import ShardedFn, copy_checkpoint, load_manifest
from tests.loader.helpers import hf_rank, state_dict_diffs
from tests.loader.test_rejections import edit_manifest, forge_entry

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

MARK = 7  # a value every dtype holds exactly: a refused shard leaves it everywhere


def plan(model_dir: Path, tp: int, dtype: str) -> ParallelPlan:
    return ParallelPlan(ModelConfig.from_dir(model_dir), tp, 1, dtype)


def marked_rank(p: ParallelPlan, rank: int):
    model = rank_model(p, rank, device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.full(param.shape, MARK, dtype=torch.float32).to(param.dtype))
    return model


def untouched(model) -> bool:
    return all(bool((p.float() == MARK).all()) for p in model.parameters())


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_writer_stores_quantized_weights_and_the_scheme(tiny_dir: Path, sharded: ShardedFn, dtype: str) -> None:
    ckpt = sharded(tiny_dir, 2, 1, dtype)
    manifest = load_manifest(ckpt)
    assert manifest.plan.dtype == dtype and manifest.plan.activation_dtype == "bfloat16"
    record = manifest.plan.quantization
    assert record["scheme"] == dtype and record["granularity"] == "per-output-channel"
    assert record["scale_dtype"] == "float32" and record["lm_head"] is True
    entry = manifest.shards[0]
    weight = {"int8": "int8", "fp8": "fp8"}[dtype]
    assert entry.tensors["model.layers.0.self_attn.qkv_proj.weight"].dtype == weight
    assert entry.tensors["model.layers.0.self_attn.qkv_proj.weight_scale"].dtype == "float32"
    assert entry.tensors["model.norm.weight"].dtype == "bfloat16"
    with open(ckpt / entry.file, "rb") as f:
        metadata = read_header(f).metadata
    assert json.loads(metadata["quantization"]) == record and metadata["dtype"] == dtype
    dense = load_manifest(sharded(tiny_dir, 2, 1, "bfloat16"))
    assert manifest.total_bytes <= 0.55 * dense.total_bytes


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_loaded_values_equal_quantizing_on_load(tiny_dir: Path, sharded: ShardedFn, dtype: str) -> None:
    ckpt = sharded(tiny_dir, 2, 1, dtype)
    p = plan_for_checkpoint(ckpt / "manifest.json", tp_degree=2, pp_degree=1)
    assert p.dtype == dtype and p.activation_dtype == "bfloat16"
    for rank in range(2):
        model = rank_model(p, rank, device="cpu")
        load_checkpoint_weights(model, p, rank, ckpt / "manifest.json")
        assert state_dict_diffs(model, hf_rank(tiny_dir, plan(tiny_dir, 2, dtype), rank)) == []


def test_tp1_and_tp2_quantize_the_same_values(tiny_dir: Path, sharded: ShardedFn) -> None:
    whole = load_file(sharded(tiny_dir, 1, 1, "int8") / "model-tp00-pp00.safetensors")
    halves = [load_file(sharded(tiny_dir, 2, 1, "int8") / f"model-tp0{r}-pp00.safetensors") for r in range(2)]
    name = "model.layers.1.mlp.down_proj"  # row-parallel: split along its input, full-row scales
    assert torch.equal(torch.cat([h[f"{name}.weight"] for h in halves], dim=1), whole[f"{name}.weight"])
    assert all(torch.equal(h[f"{name}.weight_scale"], whole[f"{name}.weight_scale"]) for h in halves)


@pytest.mark.parametrize("into", ["fp8", "bfloat16", "float32"])
def test_an_int8_checkpoint_is_refused_by_another_dtype(tiny_dir: Path, sharded: ShardedFn, into: str) -> None:
    ckpt = sharded(tiny_dir, 2, 1, "int8")
    p = plan(tiny_dir, 2, into)
    model = marked_rank(p, 0)
    with pytest.raises(ShardLayoutError, match=f"dtype: checkpoint has 'int8', plan needs '{into}'"):
        load_checkpoint_weights(model, p, 0, ckpt / "manifest.json")
    assert untouched(model)


def test_an_int8_checkpoint_renamed_fp8_is_refused(tiny_dir: Path, sharded: ShardedFn, tmp_path: Path) -> None:
    """The manifest rewritten to say fp8 (scheme included): the shard headers still say int8."""
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 1, "int8"), tmp_path / "renamed")
    fp8_record = load_manifest(sharded(tiny_dir, 2, 1, "fp8")).plan.quantization
    edit_manifest(ckpt, lambda raw: raw["plan"].update(dtype="fp8", quantization=fp8_record))
    p = plan(tiny_dir, 2, "fp8")
    model = marked_rank(p, 0)
    with pytest.raises(ShardLayoutError, match="int8") as info:
        load_checkpoint_weights(model, p, 0, ckpt / "manifest.json")
    assert "fp8" in str(info.value) and untouched(model)


def test_a_scale_of_the_wrong_shape_is_refused(tiny_dir: Path, sharded: ShardedFn, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 1, "int8"), tmp_path / "bad-scale")
    file = "model-tp00-pp00.safetensors"
    with safe_open(str(ckpt / file), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, ckpt / file, metadata=metadata)
    forge_entry(ckpt, file, tensors=True)  # the manifest agrees with the file: only the model can tell
    p = plan(tiny_dir, 2, "int8")
    model = marked_rank(p, 0)
    with pytest.raises(ShardLayoutError, match="weight_scale") as info:
        load_checkpoint_weights(model, p, 0, ckpt / "manifest.json")
    assert "[256]" in str(info.value) and "[255]" in str(info.value) and untouched(model)


def test_a_manifest_claiming_int8_over_bfloat16_data_is_refused(tiny_dir: Path, sharded: ShardedFn,
                                                                 tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 1, "bfloat16"), tmp_path / "claims-int8")
    int8 = load_manifest(sharded(tiny_dir, 2, 1, "int8"))

    def claim(raw: dict) -> None:
        raw["plan"].update(dtype="int8", activation_dtype="bfloat16", quantization=int8.plan.quantization)
        for entry, quantized in zip(raw["shards"], int8.shards, strict=True):
            entry["tensors"] = {n: t.to_dict() for n, t in quantized.tensors.items()}
    edit_manifest(ckpt, claim)
    p = plan(tiny_dir, 2, "int8")
    model = marked_rank(p, 0)
    with pytest.raises(ShardLayoutError) as info:
        load_checkpoint_weights(model, p, 0, ckpt / "manifest.json")
    message = str(info.value)
    assert "int8" in message and "bfloat16" in message and untouched(model)


def test_shard_cli_writes_int8(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli-int8"
    assert cli_main(["shard", "--model", str(tiny_dir), "--tp", "1", "--pp", "1", "--dtype", "int8",
                     "--out", str(out), "--no-progress", "--json"]) == 0
    assert load_manifest(out).plan.dtype == "int8"
    assert cli_main(["verify", "--manifest", str(out / "manifest.json"), "--tp", "1", "--pp", "1"]) == 0
    shutil.rmtree(out)
