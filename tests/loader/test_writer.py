"""The shard writer: file names, headers, manifest, tied embeddings, the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from services.cli import main as cli_main
from services.loader.layout import RankLayout, model_fingerprint
from services.loader.manifest import Manifest, shard_file_name
from services.loader.safetensors_format import read_header
from tests.loader.conftest import make_hf_model
from tests.loader.helpers import bitwise_equal, hf_rank, plan_of

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


@pytest.mark.parametrize("tp, pp", [(2, 2), (4, 1)])
def test_manifest_describes_files_exactly(tiny_dir: Path, sharded, tp: int, pp: int) -> None:
    ckpt = sharded(tiny_dir, tp, pp)
    manifest = Manifest.load(ckpt / "manifest.json")
    plan = plan_of(tiny_dir, tp, pp)
    assert manifest.model_name == "tiny"
    assert manifest.model_fingerprint == model_fingerprint(tiny_dir)
    assert manifest.model_config == json.loads((tiny_dir / "config.json").read_text())
    assert (manifest.plan.tp_degree, manifest.plan.pp_degree, manifest.plan.dtype) == (tp, pp, "float32")
    assert manifest.plan.layer_split == tuple((r.start, r.stop) for r in plan.layer_ranges)
    model_files = ["config.json", "generation_config.json"]  # what transformers wrote beside the weights
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        ["manifest.json", *model_files] + [shard_file_name(t, p) for t in range(tp) for p in range(pp)])
    assert [f.file for f in manifest.model_files] == model_files
    for model_file in manifest.model_files:
        source = (tiny_dir / model_file.file).read_bytes()
        assert (ckpt / model_file.file).read_bytes() == source
        assert (model_file.bytes, model_file.sha256) == (len(source), hashlib.sha256(source).hexdigest())
    for rank in range(plan.world_size):
        pp_stage, tp_rank = plan.coords(rank)
        entry = manifest.shard(tp_rank, pp_stage)
        path = ckpt / entry.file
        assert entry.bytes == path.stat().st_size
        assert entry.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        assert entry.tensors == RankLayout.for_rank(plan, rank).tensors
        header = read_header(open(path, "rb"))
        assert header.metadata == {
            "format": "pt", "format_version": "1", "model_fingerprint": manifest.model_fingerprint,
            "tp_degree": str(tp), "pp_degree": str(pp), "tp_rank": str(tp_rank), "pp_stage": str(pp_stage),
            "layer_start": str(entry.layer_start), "layer_end": str(entry.layer_end), "dtype": "float32"}
    assert manifest.total_bytes == sum(e.bytes for e in manifest.shards)


@pytest.mark.parametrize("tp, pp", [(2, 2), (4, 1)])
def test_each_file_holds_exactly_the_ranks_loaded_tensors(tiny_dir: Path, sharded, tp: int, pp: int) -> None:
    """The writer goes through the parameters' own weight_loaders: its bytes are the bytes a rank
    loading the HF directory holds."""
    ckpt = sharded(tiny_dir, tp, pp)
    plan = plan_of(tiny_dir, tp, pp)
    for rank in range(plan.world_size):
        reference = dict(hf_rank(tiny_dir, plan, rank).named_parameters())
        pp_stage, tp_rank = plan.coords(rank)
        with safe_open(str(ckpt / shard_file_name(tp_rank, pp_stage)), framework="pt") as f:
            assert set(f.keys()) == set(reference)
            for name in f.keys():
                assert bitwise_equal(f.get_tensor(name), reference[name].data), name


def test_tied_lm_head_saved_once_at_pp1_and_on_the_last_stage_at_pp2(tied_dir: Path, sharded) -> None:
    one = Manifest.load(sharded(tied_dir, 2, 1) / "manifest.json")
    for entry in one.shards:
        assert "lm_head.weight" not in entry.tensors and "model.embed_tokens.weight" in entry.tensors
    two = Manifest.load(sharded(tied_dir, 1, 2) / "manifest.json")
    assert "lm_head.weight" not in two.shard(0, 0).tensors
    assert "lm_head.weight" in two.shard(0, 1).tensors  # the last stage's own copy of the table
    assert "model.embed_tokens.weight" not in two.shard(0, 1).tensors


def test_dtype_conversion_and_default_dtype(tiny_dir: Path, bf16_dir: Path, sharded) -> None:
    converted = Manifest.load(sharded(tiny_dir, 2, 1, "bf16") / "manifest.json")
    assert converted.plan.dtype == "bfloat16"
    assert {i.dtype for e in converted.shards for i in e.tensors.values()} == {"bfloat16"}
    native = Manifest.load(sharded(bf16_dir, 2, 1) / "manifest.json")
    assert native.plan.dtype == "bfloat16"  # no --dtype: the checkpoint's own


def test_fingerprint_tells_same_shaped_models_apart(tiny_dir: Path, other_dir: Path, tmp_path: Path) -> None:
    assert model_fingerprint(tiny_dir) != model_fingerprint(other_dir)
    again = make_hf_model(tmp_path / "again", seed=0)
    assert model_fingerprint(again) == model_fingerprint(tiny_dir)  # deterministic


def test_cli_shard_then_verify(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "ckpt"
    assert cli_main(["shard", "--model", str(tiny_dir), "--tp", "2", "--pp", "2", "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # not a terminal: no progress bar
    summary = json.loads(captured.out)
    assert summary["plan"] == {"tp_degree": 2, "pp_degree": 2, "dtype": "float32", "layer_split": [[0, 2], [2, 4]]}
    assert len(summary["shards"]) == 4
    assert cli_main(["verify", "--manifest", str(out / "manifest.json"), "--tp", "2", "--pp", "2",
                     "--model", str(tiny_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["total_bytes"] == summary["total_bytes"]


def test_cli_refuses_a_plan_the_model_cannot_take(tiny_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["shard", "--model", str(tiny_dir), "--tp", "3", "--pp", "1", "--out", str(tmp_path / "x")]) == 2
    assert "tp_degree=3 does not divide num_attention_heads=8" in capsys.readouterr().err
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_multi_file_hf_checkpoint(tmp_path: Path, sharded) -> None:
    """An HF directory split into several safetensors files with an index shards the same way."""
    model_dir = make_hf_model(tmp_path / "split", seed=4, max_shard_size="1MB")
    assert (model_dir / "model.safetensors.index.json").exists()
    ckpt = sharded(model_dir, 2, 2)
    plan = plan_of(model_dir, 2, 2)
    for rank in range(plan.world_size):
        pp_stage, tp_rank = plan.coords(rank)
        reference = dict(hf_rank(model_dir, plan, rank).named_parameters())
        with safe_open(str(ckpt / shard_file_name(tp_rank, pp_stage)), framework="pt") as f:
            assert all(bitwise_equal(f.get_tensor(n), reference[n].data) for n in f.keys())


def test_verify_cli_against_another_models_directory(tiny_dir: Path, other_dir: Path, sharded,
                                                     capsys: pytest.CaptureFixture) -> None:
    ckpt = sharded(tiny_dir, 2, 2)
    assert cli_main(["verify", "--manifest", str(ckpt), "--tp", "2", "--pp", "2", "--model", str(other_dir)]) == 1
    assert f"is from another model: fingerprint {model_fingerprint(tiny_dir)}" in capsys.readouterr().err
