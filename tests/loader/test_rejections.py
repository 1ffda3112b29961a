"""Every wrong shard is refused before any weight reaches the model, with what differs.

Each case loads into a rank whose weights all hold a sentinel and checks, after the error, that
they still do. The "forged" cases go further than an honest mistake: files renamed and the
manifest rewritten to match them, so that only a deeper check (the header, then the model's
own shapes) can tell.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from services.cli import main as cli_main
from services.loader.errors import ManifestError, ObjectNotFound, ShardChecksumError, ShardLayoutError
from services.loader.layout import model_fingerprint
from services.loader.manifest import TensorInfo
from services.loader.safetensors_format import encode_header, read_header
from services.worker.rank_loading import load_checkpoint_weights
from tests.loader.conftest import copy_checkpoint
from tests.loader.helpers import plan_of, sentinel_rank, untouched

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


def refused(model_dir: Path, ckpt: Path, tp: int, pp: int, rank: int, exc: type[Exception], match: str, *,
            dtype: str = "float32", fingerprint: str | None = None) -> str:
    plan = plan_of(model_dir, tp, pp, dtype)
    model = sentinel_rank(plan, rank)
    with pytest.raises(exc, match=match) as info:
        load_checkpoint_weights(model, plan, rank, ckpt / "manifest.json", expected_fingerprint=fingerprint)
    assert untouched(model), "a refused shard reached the model"
    return str(info.value)


def edit_manifest(ckpt: Path, edit) -> None:
    path = ckpt / "manifest.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def forge_entry(ckpt: Path, file: str, *, tensors: bool = False) -> None:
    """Rewrite the manifest entry of ``file`` to match the file now there (size, sha256, and
    optionally its tensor list): a manifest that no longer protects anything by itself."""
    path = ckpt / file
    header = read_header(open(path, "rb"))

    def edit(raw: dict) -> None:
        for entry in raw["shards"]:
            if entry["file"] == file:
                entry["bytes"] = path.stat().st_size
                entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
                if tensors:
                    entry["tensors"] = {t.name: TensorInfo(t.shape, t.dtype).to_dict() for t in header.tensors}
        raw["total_bytes"] = sum(e["bytes"] for e in raw["shards"])
    edit_manifest(ckpt, edit)


def rewrite_metadata(path: Path, **changes: str) -> None:
    """Rewrite a shard's header metadata, keeping its tensors and data."""
    data = path.read_bytes()
    header = read_header(open(path, "rb"))
    new_header, _ = encode_header([(t.name, t.dtype, t.shape) for t in header.tensors],
                                  {**header.metadata, **changes})
    path.write_bytes(new_header + data[header.data_start:])


@pytest.mark.parametrize("offset", [-100, 20], ids=["data", "header"])
def test_one_flipped_byte(tiny_dir: Path, sharded, tmp_path: Path, offset: int) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")
    path = ckpt / "model-tp01-pp01.safetensors"
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    refused(tiny_dir, ckpt, 2, 2, 3, ShardChecksumError,
            r"sha256 [0-9a-f]{64}, manifest says [0-9a-f]{64} for model-tp01-pp01.safetensors")


def test_truncated_shard(tiny_dir: Path, sharded, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")
    path = ckpt / "model-tp00-pp00.safetensors"
    full = path.stat().st_size
    path.write_bytes(path.read_bytes()[:full // 2])
    refused(tiny_dir, ckpt, 2, 2, 0, ShardChecksumError,
            f"{full // 2} bytes, manifest says {full} for model-tp00-pp00.safetensors \\(short: truncated")


def test_shard_missing_from_the_manifest(tiny_dir: Path, sharded, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")

    def drop(raw: dict) -> None:
        raw["shards"] = [e for e in raw["shards"] if e["file"] != "model-tp01-pp00.safetensors"]
        raw["total_bytes"] = sum(e["bytes"] for e in raw["shards"])
    edit_manifest(ckpt, drop)
    # even the ranks whose own shard is listed refuse an incomplete checkpoint
    refused(tiny_dir, ckpt, 2, 2, 0, ManifestError, r"lacks \['model-tp01-pp00.safetensors'\]")


def test_shard_listed_but_absent(tiny_dir: Path, sharded, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")
    (ckpt / "model-tp01-pp00.safetensors").unlink()
    refused(tiny_dir, ckpt, 2, 2, 1, ObjectNotFound, "model-tp01-pp00.safetensors .* is missing")


def test_manifest_listing_a_parent_path(tiny_dir: Path, sharded, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")
    shutil.copy(ckpt / "model-tp00-pp00.safetensors", tmp_path / "x.safetensors")  # bait outside the checkpoint
    edit_manifest(ckpt, lambda raw: raw["shards"][0].update(file="../x.safetensors"))
    refused(tiny_dir, ckpt, 2, 2, 0, ManifestError, r"'\.\./x\.safetensors' is not a plain file name")


def test_tp4_shards_under_a_tp2_plan(tiny_dir: Path, sharded) -> None:
    message = refused(tiny_dir, sharded(tiny_dir, 4, 1), 2, 1, 0, ShardLayoutError,
                      "tp_degree: checkpoint has 4, plan needs 2")
    assert "cut for tp=4 pp=1" in message


def test_tp4_shards_renamed_to_the_tp2_names(tiny_dir: Path, sharded, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 1), tmp_path / "ckpt")
    tp4 = sharded(tiny_dir, 4, 1)
    for name in ("model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"):
        shutil.copy(tp4 / name, ckpt / name)
    # 1. the manifest is the TP=2 one: the bytes differ, and the header says why
    refused(tiny_dir, ckpt, 2, 1, 1, ShardChecksumError,
            "for model-tp01-pp00.safetensors \\(short: .*\\); its header says tp_degree '4' \\(expected '2'\\)")
    # 2. the manifest is rewritten to the new bytes: the file's header still says TP=4
    forge_entry(ckpt, "model-tp01-pp00.safetensors")
    refused(tiny_dir, ckpt, 2, 1, 1, ShardLayoutError, "header metadata does not match .*"
            "tp_degree: expected '2', file has '4'")
    # 3. the header is rewritten to claim TP=2 too: its tensors are still TP=4 slices
    rewrite_metadata(ckpt / "model-tp01-pp00.safetensors", tp_degree="2")
    forge_entry(ckpt, "model-tp01-pp00.safetensors")
    refused(tiny_dir, ckpt, 2, 1, 1, ShardLayoutError, "tensors differ from manifest entry .*"
            r"qkv_proj.weight: expected \[256, 256\] float32, got \[128, 256\] float32")
    # 4. and the manifest's tensor list as well: the rank's own model expects other shapes
    forge_entry(ckpt, "model-tp01-pp00.safetensors", tensors=True)
    refused(tiny_dir, ckpt, 2, 1, 1, ShardLayoutError, "does not hold what this rank's model expects: .*"
            r"expected \[256, 256\] float32, got \[128, 256\] float32")


def test_bf16_checkpoint_under_a_float32_plan(bf16_dir: Path, sharded, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(sharded(bf16_dir, 2, 1), tmp_path / "ckpt")
    refused(bf16_dir, ckpt, 2, 1, 0, ShardLayoutError, "dtype: checkpoint has 'bfloat16', plan needs 'float32'")
    # a manifest claiming float32 over bf16 files: the tensors give it away
    edit_manifest(ckpt, lambda raw: raw["plan"].update(dtype="float32"))
    refused(bf16_dir, ckpt, 2, 1, 0, ShardLayoutError, r"expected \[\d+(, \d+)*\] float32, got \[\d+(, \d+)*\] bfloat16")


def test_shard_from_another_model(tiny_dir: Path, other_dir: Path, sharded, tmp_path: Path) -> None:
    # a whole checkpoint of a same-shaped model, against the model the worker was given
    other = sharded(other_dir, 2, 2)
    message = refused(tiny_dir, other, 2, 2, 0, ShardLayoutError, "is from another model: fingerprint",
                      fingerprint=model_fingerprint(tiny_dir))
    assert model_fingerprint(tiny_dir) in message and model_fingerprint(other_dir) in message
    # one file of it slipped into our checkpoint, manifest rewritten to its bytes
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")
    shutil.copy(other / "model-tp00-pp01.safetensors", ckpt / "model-tp00-pp01.safetensors")
    forge_entry(ckpt, "model-tp00-pp01.safetensors")
    refused(tiny_dir, ckpt, 2, 2, 2, ShardLayoutError,
            f"model_fingerprint: expected '{model_fingerprint(tiny_dir)}', file has '{model_fingerprint(other_dir)}'")


def test_verify_cli_reports_the_damage(tiny_dir: Path, sharded, tmp_path: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    ckpt = copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")
    assert cli_main(["verify", "--manifest", str(ckpt)]) == 0
    capsys.readouterr()
    path = ckpt / "model-tp01-pp00.safetensors"
    path.write_bytes(path.read_bytes()[:-1])
    assert cli_main(["verify", "--manifest", str(ckpt / "manifest.json")]) == 1
    err = capsys.readouterr().err
    assert "model-tp01-pp00.safetensors" in err and "(short: truncated" in err
    assert cli_main(["verify", "--manifest", str(sharded(tiny_dir, 4, 1)), "--tp", "2"]) == 1
    assert "tp_degree: checkpoint has 4, plan needs 2" in capsys.readouterr().err
