"""A checkpoint carries the model's config and tokenizer files beside its shards, listed in the
manifest with their sha256: a worker given only the checkpoint can tokenize, and verification
covers those files as it covers the shards."""

from __future__ import annotations

import copy
import hashlib
import io
import json
from pathlib import Path
from typing import BinaryIO

import pytest
from tokenizers import Tokenizer

from services.cli import main as cli_main
from services.loader.errors import ManifestError, ObjectNotFound, ShardChecksumError
from services.loader.manifest import Manifest
from services.loader.object_store import LocalStore, open_store
from services.loader.staging import model_files_dir, stage_model_files
from services.loader.verify import verify_checkpoint
from services.loader.writer import ShardJob, write_shards
from tests.loader.conftest import copy_checkpoint
from tests.loader.test_rejections import edit_manifest

TOKENIZER_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
TEXT = "Shards carry no tokenizer — until now."


@pytest.fixture(scope="module")
def with_tokenizer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``shardline model tiny`` (it writes tokenizer.json) cut at TP2/PP1."""
    out = tmp_path_factory.mktemp("ckpt-tok")
    write_shards(ShardJob(tiny_model_dir, 2, 1, str(out)), progress=False)
    return out


def test_the_tokenizer_files_are_copied_and_listed(tiny_model_dir: Path, with_tokenizer: Path) -> None:
    manifest = Manifest.load(with_tokenizer / "manifest.json")
    assert [f.file for f in manifest.model_files] == TOKENIZER_FILES
    for entry in manifest.model_files:
        data = (with_tokenizer / entry.file).read_bytes()
        assert data == (tiny_model_dir / entry.file).read_bytes()
        assert (entry.bytes, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert manifest.total_bytes == sum(s.bytes for s in manifest.shards)  # weights only
    # the checkpoint alone tokenizes exactly as the model directory does
    ids = Tokenizer.from_file(str(with_tokenizer / "tokenizer.json")).encode(TEXT).ids
    assert ids == Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(TEXT).ids
    assert stage_model_files(with_tokenizer / "manifest.json") == with_tokenizer.resolve()  # verified in place


def test_verify_covers_the_model_files(with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    report = verify_checkpoint(with_tokenizer)
    assert [f.file for f in report.model_files] == TOKENIZER_FILES
    assert cli_main(["verify", "--manifest", str(with_tokenizer), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [f["file"] for f in out["model_files"]] == TOKENIZER_FILES

    ckpt = copy_checkpoint(with_tokenizer, tmp_path / "ckpt")
    tok = ckpt / "tokenizer.json"
    data = bytearray(tok.read_bytes())
    data[len(data) // 2] ^= 0x20
    tok.write_bytes(bytes(data))
    with pytest.raises(ShardChecksumError, match=r"tokenizer.json: sha256 [0-9a-f]{64}, manifest says [0-9a-f]{64} "
                                                 r"for tokenizer.json"):
        verify_checkpoint(ckpt)
    with pytest.raises(ShardChecksumError, match="tokenizer.json"):
        stage_model_files(ckpt)
    assert cli_main(["verify", "--manifest", str(ckpt)]) == 1
    assert "tokenizer.json" in capsys.readouterr().err

    tok.unlink()
    with pytest.raises(ObjectNotFound, match="tokenizer.json"):
        verify_checkpoint(ckpt)


class CountingStore(LocalStore):
    """A local store that counts downloads and damages the first ``bad`` of tokenizer.json."""

    def __init__(self, root: Path, *, bad: int = 0) -> None:
        super().__init__(root)
        self.bad = bad
        self.opened: list[str] = []

    def open(self, key: str) -> BinaryIO:
        self.opened.append(key)
        with super().open(key) as stream:
            data = stream.read()
        if key == "tokenizer.json" and self.opened.count(key) <= self.bad:
            data = data[:-1]
        return io.BytesIO(data)


def test_stage_model_files_into_a_cache_then_hit(with_tokenizer: Path, tmp_path: Path) -> None:
    store = CountingStore(with_tokenizer, bad=2)
    cache = tmp_path / "cache"
    target = stage_model_files(with_tokenizer, cache_dir=cache, store=store)
    manifest = Manifest.load(with_tokenizer / "manifest.json")
    assert target == model_files_dir(cache, manifest)
    assert sorted(p.name for p in target.iterdir()) == sorted(TOKENIZER_FILES)  # no partial left behind
    assert store.opened.count("tokenizer.json") == 3  # two damaged downloads retried
    assert Tokenizer.from_file(str(target / "tokenizer.json")).encode(TEXT).ids
    store.opened.clear()
    assert stage_model_files(with_tokenizer, cache_dir=cache, store=store) == target
    assert store.opened == ["manifest.json"]  # all four were cache hits, re-hashed, not downloaded


def test_stage_model_files_from_s3(tiny_model_dir: Path, s3_bucket: str, tmp_path: Path) -> None:
    prefix = f"s3://{s3_bucket}/tiny-tok"
    assert cli_main(["shard", "--model", str(tiny_model_dir), "--tp", "1", "--pp", "2", "--out", prefix,
                     "--no-progress"]) == 0
    assert set(TOKENIZER_FILES) <= set(open_store(prefix).list())
    target = stage_model_files(f"{prefix}/manifest.json", cache_dir=tmp_path / "cache")
    assert target is not None and target.is_relative_to(tmp_path / "cache")
    for name in TOKENIZER_FILES:
        assert (target / name).read_bytes() == (tiny_model_dir / name).read_bytes()


def test_manifests_without_model_files_still_read_and_verify(with_tokenizer: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(with_tokenizer, tmp_path / "ckpt")
    edit_manifest(ckpt, lambda raw: raw.pop("model_files"))
    assert verify_checkpoint(ckpt).model_files == ()
    assert stage_model_files(ckpt, cache_dir=tmp_path / "cache") is None
    assert "model_files" not in Manifest.load(ckpt / "manifest.json").to_dict()


@pytest.mark.parametrize("edit, says", [
    (lambda files: files[0].update(file="../tokenizer.json"), "'../tokenizer.json' is not a plain file name"),
    (lambda files: files[0].update(file="manifest.json"), "would collide with the manifest or a shard"),
    (lambda files: files[1].update(file="model-tp00-pp00.safetensors"), "would collide"),
    (lambda files: files.append(dict(files[0])), r"lists \['config.json'\] more than once"),
    (lambda files: files[2].update(sha256="xyz"), "tokenizer.json: sha256 'xyz' is not 64 lowercase hex"),
    (lambda files: files[2].update(bytes=-1), "tokenizer.json: bytes must be a non-negative integer"),
    (lambda files: files[2].pop("sha256"), r"model_files\[2\] \(tokenizer.json\): missing field 'sha256'"),
])
def test_malformed_model_file_entries_are_refused(with_tokenizer: Path, edit, says: str) -> None:
    raw = json.loads((with_tokenizer / "manifest.json").read_text())
    bad = copy.deepcopy(raw)
    edit(bad["model_files"])
    with pytest.raises(ManifestError, match=says):
        Manifest.from_dict(bad)
    assert Manifest.from_dict(raw).to_dict() == raw  # the untouched one round-trips
