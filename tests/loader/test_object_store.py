"""The object store interface, run against a local directory and a real S3-API server (moto)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.loader.errors import ObjectNotFound
from services.loader.object_store import (
    LocalStore,
    ObjectStore,
    ObjectStoreError,
    S3Store,
    open_store,
    split_object_uri,
)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return open_store(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/models/tiny")


def test_put_get_open_list_size_exists(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    payload = bytes(range(256)) * 4099  # > 1 MiB, not a multiple of any chunk size
    src.write_bytes(payload)
    store.put_file("model-tp00-pp00.safetensors", src)
    store.put_bytes("manifest.json", b"{}")
    store.put_bytes("sub/inner.txt", b"x")
    assert store.exists("manifest.json") and not store.exists("nope.json")
    assert store.size("model-tp00-pp00.safetensors") == len(payload)
    assert store.read_bytes("manifest.json") == b"{}"
    with store.open("model-tp00-pp00.safetensors") as stream:
        assert stream.read(10) == payload[:10]
        assert stream.read() == payload[10:]
    dest = tmp_path / "dest.bin"
    store.get_file("model-tp00-pp00.safetensors", dest)
    assert dest.read_bytes() == payload
    assert store.list() == ["manifest.json", "model-tp00-pp00.safetensors", "sub/inner.txt"]
    assert store.list("model-") == ["model-tp00-pp00.safetensors"]
    assert store.uri_for("manifest.json").endswith("/manifest.json")
    store.delete("sub/inner.txt")
    store.delete("sub/inner.txt")  # absent: no error
    assert not store.exists("sub/inner.txt")


def test_missing_objects_are_not_found(store: ObjectStore, tmp_path: Path) -> None:
    for call in (lambda: store.open("absent.bin"), lambda: store.size("absent.bin"),
                 lambda: store.read_bytes("absent.bin")):
        with pytest.raises(ObjectNotFound, match="absent.bin"):
            call()


@pytest.mark.parametrize("key", ["../escape", "/abs", "a/../../b", "", "a\\b"])
def test_keys_cannot_escape_the_root(store: ObjectStore, key: str) -> None:
    with pytest.raises(ObjectStoreError, match="must be a relative path"):
        store.put_bytes(key, b"x")


def test_open_store_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    s3 = open_store("s3://bucket/a/b/", endpoint_url="http://127.0.0.1:1")
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix, s3.endpoint_url) == ("bucket", "a/b", "http://127.0.0.1:1")
    with pytest.raises(ObjectStoreError, match="expected a directory, file:// or s3://"):
        open_store("gs://bucket/x")


def test_endpoint_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    assert open_store("s3://b/p").endpoint_url == "http://127.0.0.1:9"
    assert open_store("s3://b/p", endpoint_url="http://127.0.0.1:7").endpoint_url == "http://127.0.0.1:7"


def test_split_object_uri() -> None:
    assert split_object_uri("s3://b/p/manifest.json", default_name="manifest.json") == ("s3://b/p", "manifest.json")
    assert split_object_uri("s3://b/p/", default_name="manifest.json") == ("s3://b/p", "manifest.json")
    assert split_object_uri("/d/m.json", default_name="manifest.json") == ("/d", "m.json")
    assert split_object_uri("/m.json", default_name="manifest.json") == ("/", "m.json")
    assert split_object_uri("m.json", default_name="manifest.json") == (".", "m.json")
    assert split_object_uri("/d", default_name="manifest.json") == ("/d", "manifest.json")


def test_missing_bucket_is_not_found(s3_endpoint: str) -> None:
    with pytest.raises(ObjectNotFound, match="s3://no-such-bucket-here/x/manifest.json"):
        open_store("s3://no-such-bucket-here/x").read_bytes("manifest.json")
