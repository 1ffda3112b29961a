"""manifest.json: round trip, and every malformed manifest refused with what is wrong."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from services.common.errors import InvalidArgument
from services.loader.errors import ManifestError
from services.loader.manifest import FORMAT_VERSION, Manifest, check_plain_file_name, expected_metadata, shard_file_name

SHA = "ab" * 32


def manifest_dict(tp: int = 2, pp: int = 2) -> dict[str, Any]:
    split = [[0, 2], [2, 4]] if pp == 2 else [[0, 4]]
    shards = [{"file": shard_file_name(t, p), "tp_rank": t, "pp_stage": p, "bytes": 1000, "sha256": SHA,
               "layer_start": split[p][0], "layer_end": split[p][1],
               "tensors": {"model.norm.weight": {"shape": [256], "dtype": "float32"}}}
              for p in range(pp) for t in range(tp)]
    return {"format_version": FORMAT_VERSION, "model_name": "tiny", "model_config": {"num_hidden_layers": 4},
            "model_fingerprint": "cd" * 32, "plan": {"tp_degree": tp, "pp_degree": pp, "dtype": "float32",
                                                      "layer_split": split},
            "shards": shards, "total_bytes": 1000 * tp * pp}


def test_round_trip_keeps_every_field() -> None:
    manifest = Manifest.from_dict(manifest_dict())
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest
    assert again.to_dict() == manifest_dict()
    assert manifest.shard(1, 1).file == "model-tp01-pp01.safetensors"
    assert manifest.shard(1, 1).layer_range == range(2, 4)


def test_save_and_load(tmp_path) -> None:
    manifest = Manifest.from_dict(manifest_dict(4, 1))
    manifest.save(tmp_path / "manifest.json")
    assert Manifest.load(tmp_path / "manifest.json") == manifest


def test_shard_names_follow_the_template() -> None:
    assert shard_file_name(0, 0) == "model-tp00-pp00.safetensors"
    assert shard_file_name(3, 12) == "model-tp03-pp12.safetensors"


@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd", "a/model-tp00-pp00.safetensors",
                                  "..", "sub\\model-tp00-pp00.safetensors", "model..safetensors", ""])
def test_unsafe_shard_names_are_refused(name: str) -> None:
    with pytest.raises(ManifestError, match="plain file name|non-empty"):
        check_plain_file_name(name)
    raw = manifest_dict()
    raw["shards"][0]["file"] = name
    with pytest.raises(ManifestError) as info:
        Manifest.from_dict(raw)
    assert repr(name)[1:-1] in str(info.value) or name == ""


def test_manifest_listing_parent_path_is_refused_with_the_name() -> None:
    raw = manifest_dict()
    raw["shards"][0]["file"] = "../x.safetensors"
    with pytest.raises(ManifestError, match=r"'\.\./x\.safetensors' is not a plain file name"):
        Manifest.from_json(json.dumps(raw), source="s3://b/m/manifest.json")


def test_name_must_match_its_rank() -> None:
    raw = manifest_dict()
    raw["shards"][0]["file"] = "model-tp01-pp00.safetensors"  # listed as tp_rank 0
    with pytest.raises(ManifestError, match="tp_rank=0 pp_stage=0 is named 'model-tp01-pp00.safetensors', "
                                            "expected 'model-tp00-pp00.safetensors'"):
        Manifest.from_dict(raw)


def test_missing_shard_is_named() -> None:
    raw = manifest_dict()
    del raw["shards"][3]
    raw["total_bytes"] = 3000
    with pytest.raises(ManifestError, match=r"needs 4 shards; the manifest lacks \['model-tp01-pp01.safetensors'\]"):
        Manifest.from_dict(raw)


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m["shards"].append(copy.deepcopy(m["shards"][0])), "listed twice"),
    (lambda m: m.update(total_bytes=1), "total_bytes is 1, the shards sum to 4000"),
    (lambda m: m.update(format_version=2), "format_version 2 is not supported: this build reads version 1"),
    (lambda m: m["plan"].update(dtype="int4"), "unknown dtype 'int4'"),
    (lambda m: m["plan"].update(layer_split=[[0, 2], [3, 4]]), "stage 1 is \\[3, 4\\)"),
    (lambda m: m["model_config"].update(num_hidden_layers=6), "covers 4 layers, model_config.num_hidden_layers is 6"),
    (lambda m: m["shards"][1].update(layer_start=1), "layers \\[1, 2\\) differ from the plan's stage 0"),
    (lambda m: m["shards"][1].update(sha256="xyz"), "not 64 lowercase hex"),
    (lambda m: m["shards"][1].update(tp_rank=5, file="model-tp05-pp00.safetensors"), "outside the plan"),
    (lambda m: m["shards"][1].pop("sha256"), "missing field 'sha256'"),
    (lambda m: m["shards"][1].update(bytes="12"), "bytes: expected int, got str"),
    (lambda m: m.pop("plan"), "missing field 'plan'"),
])
def test_malformed_manifests_say_what_is_wrong(mutate, message: str) -> None:
    raw = manifest_dict()
    mutate(raw)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict(raw)


def test_not_json() -> None:
    with pytest.raises(ManifestError, match="m.json: not valid JSON"):
        Manifest.from_json("{nope", source="m.json")


def test_manifest_error_is_an_invalid_argument() -> None:
    assert issubclass(ManifestError, InvalidArgument)


def test_expected_metadata_names_the_rank_and_plan() -> None:
    manifest = Manifest.from_dict(manifest_dict())
    meta = expected_metadata(manifest, manifest.shard(1, 1))
    assert meta == {"format": "pt", "format_version": "1", "model_fingerprint": "cd" * 32, "tp_degree": "2",
                    "pp_degree": "2", "tp_rank": "1", "pp_stage": "1", "layer_start": "2", "layer_end": "4",
                    "dtype": "float32"}
