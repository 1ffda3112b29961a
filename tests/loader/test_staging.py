"""Staging one rank's shard into the node-local cache: verified downloads, retries, cache hits."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import BinaryIO

import pytest

from services.loader.errors import ShardChecksumError, ShardLayoutError
from services.loader.manifest import Manifest
from services.loader.object_store import LocalStore
from services.loader.staging import cache_path, stage
from tests.loader.conftest import copy_checkpoint
from tests.loader.test_rejections import forge_entry, rewrite_metadata

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


class FlakyStore(LocalStore):
    """A local store whose first ``bad`` downloads arrive damaged (a flipped byte, or cut short)."""

    def __init__(self, root: Path, *, bad: int = 0, damage: str = "flip") -> None:
        super().__init__(root)
        self.bad = bad
        self.damage = damage
        self.opened: list[str] = []

    def open(self, key: str) -> BinaryIO:
        self.opened.append(key)
        with super().open(key) as stream:
            data = stream.read()
        if key.endswith(".safetensors") and len([k for k in self.opened if k == key]) <= self.bad:
            if self.damage == "flip":
                data = data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:]
            else:
                data = data[:len(data) // 3]
        return io.BytesIO(data)


@pytest.fixture
def ckpt(tiny_dir: Path, sharded, tmp_path: Path) -> Path:
    return copy_checkpoint(sharded(tiny_dir, 2, 2), tmp_path / "ckpt")


def test_stage_then_cache_hit_without_download(ckpt: Path, tmp_path: Path) -> None:
    store = FlakyStore(ckpt)
    first = stage(ckpt / "manifest.json", 1, 0, cache_dir=tmp_path / "cache", store=store)
    entry = Manifest.load(ckpt / "manifest.json").shard(1, 0)
    assert first.local_path == cache_path(tmp_path / "cache", entry)
    assert first.local_path.read_bytes() == (ckpt / entry.file).read_bytes()
    assert (first.cache_hit, first.attempts, first.sha256, first.bytes) == (False, 1, entry.sha256, entry.bytes)
    assert store.opened == ["manifest.json", entry.file]
    second = stage(ckpt / "manifest.json", 1, 0, cache_dir=tmp_path / "cache", store=store)
    assert (second.cache_hit, second.attempts, second.local_path) == (True, 0, first.local_path)
    assert store.opened == ["manifest.json", entry.file, "manifest.json"]  # no second download
    assert second.verify_ns > 0
    assert sorted(p.name for p in first.local_path.parent.iterdir()) == [entry.file]  # no partial left


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_damaged_downloads_are_retried_with_fresh_downloads(ckpt: Path, tmp_path: Path, damage: str) -> None:
    store = FlakyStore(ckpt, bad=2, damage=damage)
    result = stage(ckpt / "manifest.json", 0, 1, cache_dir=tmp_path / "cache", store=store)
    assert (result.attempts, result.cache_hit) == (3, False)
    assert store.opened.count("model-tp00-pp01.safetensors") == 3


def test_still_damaged_after_every_attempt_fails_loudly(ckpt: Path, tmp_path: Path) -> None:
    store = FlakyStore(ckpt, bad=99)
    with pytest.raises(ShardChecksumError, match=r"still wrong after 3 download attempt\(s\): "
                                                 r"attempt 1: .*sha256 .* \| attempt 2: .* \| attempt 3: "):
        stage(ckpt / "manifest.json", 0, 1, cache_dir=tmp_path / "cache", store=store)
    assert store.opened.count("model-tp00-pp01.safetensors") == 3
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []  # nothing half-written stays
    with pytest.raises(ShardChecksumError, match="after 5 download attempt"):
        stage(ckpt / "manifest.json", 0, 1, cache_dir=tmp_path / "cache", store=FlakyStore(ckpt, bad=99), attempts=5)


def test_a_damaged_cache_entry_is_downloaded_again(ckpt: Path, tmp_path: Path) -> None:
    first = stage(ckpt, 1, 1, cache_dir=tmp_path / "cache")
    first.local_path.write_bytes(first.local_path.read_bytes()[:100])
    again = stage(ckpt, 1, 1, cache_dir=tmp_path / "cache")
    assert (again.cache_hit, again.attempts) == (False, 1)
    assert again.local_path.stat().st_size == first.bytes


def test_layout_mismatch_is_not_retried(ckpt: Path, tmp_path: Path) -> None:
    """A header that contradicts its manifest entry is the same on every download: fail at once."""
    rewrite_metadata(ckpt / "model-tp00-pp00.safetensors", pp_stage="1")
    forge_entry(ckpt, "model-tp00-pp00.safetensors")
    store = FlakyStore(ckpt)
    with pytest.raises(ShardLayoutError, match="pp_stage: expected '0', file has '1'") as info:
        stage(ckpt / "manifest.json", 0, 0, cache_dir=tmp_path / "cache", store=store)
    assert not isinstance(info.value, ShardChecksumError)
    assert store.opened.count("model-tp00-pp00.safetensors") == 1


def test_stage_refuses_unknown_ranks(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardLayoutError, match="no shard for tp_rank=2 pp_stage=0: the manifest was cut for tp=2 pp=2"):
        stage(ckpt, 2, 0, cache_dir=tmp_path / "cache")


def test_cache_is_content_addressed(ckpt: Path, tmp_path: Path) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    a = stage(ckpt, 0, 0, cache_dir=tmp_path / "cache")
    b = stage(ckpt, 1, 0, cache_dir=tmp_path / "cache")
    assert a.local_path.parent.name == manifest["shards"][0]["sha256"]
    assert a.local_path != b.local_path


class DroppingStore(LocalStore):
    """A store whose first download drops the connection halfway."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.dropped = False

    def transient_errors(self) -> tuple[type[BaseException], ...]:
        return (ConnectionError,)

    def open(self, key: str) -> BinaryIO:
        stream = super().open(key)
        if not key.endswith(".safetensors") or self.dropped:
            return stream
        self.dropped = True
        data = stream.read()
        stream.close()

        class Dropping(io.BytesIO):
            def read(self, n: int = -1) -> bytes:
                if self.tell() > len(data) // 2:
                    raise ConnectionError("connection reset by peer")
                return super().read(n if n < 0 else min(n, 4096))
        return Dropping(data)


def test_a_dropped_connection_is_a_failed_attempt(ckpt: Path, tmp_path: Path) -> None:
    result = stage(ckpt, 1, 1, cache_dir=tmp_path / "cache", store=DroppingStore(ckpt))
    assert (result.attempts, result.cache_hit) == (2, False)
