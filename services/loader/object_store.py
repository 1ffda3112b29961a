"""Where checkpoints live: one small interface, a local-directory backend and an S3 backend.

A store is rooted at a URI (a directory path, ``file:///dir`` or ``s3://bucket/prefix``) and
addresses objects by relative keys (``manifest.json``, ``model-tp00-pp00.safetensors``). Keys
never climb out of the root. The S3 backend talks to any S3-compatible server: its endpoint comes
from ``endpoint_url=`` or ``SHARDLINE_S3_ENDPOINT_URL`` (else boto3's own resolution, including
``AWS_ENDPOINT_URL``), credentials from the usual AWS environment variables / config files.
"""

from __future__ import annotations

import abc
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from services.common.errors import InvalidArgument
from services.loader.errors import ObjectNotFound

ENDPOINT_ENV = "SHARDLINE_S3_ENDPOINT_URL"
COPY_CHUNK_BYTES = 8 * 1024 * 1024


class ObjectStoreError(InvalidArgument):
    """A store URI or object key that cannot be used (unknown scheme, key escaping the root)."""


def check_key(key: str) -> str:
    """A relative key made of plain path parts (no ``..``, no leading ``/``, no empty part)."""
    parts = PurePosixPath(key).parts if key else ()
    if not parts or key.startswith("/") or "\\" in key or any(p in ("..", ".") for p in parts):
        raise ObjectStoreError(f"object key {key!r} must be a relative path without '..' or a leading '/'")
    return "/".join(parts)


class ObjectStore(abc.ABC):
    """Flat key → bytes storage under one root."""

    uri: str

    @abc.abstractmethod
    def put_file(self, key: str, path: str | Path) -> None:
        """Upload a local file to ``key`` (replacing any object there)."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def open(self, key: str) -> BinaryIO:
        """A readable binary stream of the object (a fresh download for remote stores); close it."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` (relative to the root), sorted."""

    @abc.abstractmethod
    def size(self, key: str) -> int: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if it exists (no error when it does not)."""

    def read_bytes(self, key: str) -> bytes:
        with self.open(key) as stream:
            return stream.read()

    def get_file(self, key: str, path: str | Path) -> None:
        """Download ``key`` to the local ``path`` (streamed)."""
        with self.open(key) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, COPY_CHUNK_BYTES)

    def uri_for(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{check_key(key)}"

    def local_path(self, key: str) -> Path | None:
        """The object's path on this machine, for stores that have one (local directories)."""
        return None

    def transient_errors(self) -> tuple[type[BaseException], ...]:
        """Errors of a read that a fresh download may not repeat (dropped connection, timeout)."""
        return ()


class LocalStore(ObjectStore):
    """A directory on this machine (created on the first write)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def put_file(self, key: str, path: str | Path) -> None:
        dest = self._path(key)
        if Path(path).resolve() == dest:
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".partial")
        shutil.copyfile(path, tmp)
        os.replace(tmp, dest)

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".partial")
        tmp.write_bytes(data)
        os.replace(tmp, dest)

    def open(self, key: str) -> BinaryIO:
        path = self._path(key)
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise ObjectNotFound(f"{path}: no such object in {self.uri}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        keys = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        return sorted(k for k in keys if k.startswith(prefix))

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise ObjectNotFound(f"{self._path(key)}: no such object in {self.uri}") from None


class S3Store(ObjectStore):
    """``s3://bucket/prefix`` through boto3, on AWS or any S3-API server (MinIO, moto, Ceph …)."""

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 client: Any | None = None) -> None:
        if not bucket:
            raise ObjectStoreError("s3:// URI needs a bucket: s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url or os.environ.get(ENDPOINT_ENV) or None
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            # deferred: boto3 only for an s3:// store (local stores need no AWS SDK)
            import boto3

            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            self._client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name=region)
        return self._client

    def transient_errors(self) -> tuple[type[BaseException], ...]:
        # deferred: boto3 only for an s3:// store
        from botocore.exceptions import BotoCoreError  # transport errors; not ClientError (4xx/5xx answers)

        return (BotoCoreError, ConnectionError, TimeoutError)

    def _key(self, key: str) -> str:
        key = check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _not_found(self, exc: Exception, key: str) -> bool:
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")

    def put_file(self, key: str, path: str | Path) -> None:
        self.client.upload_file(str(path), self.bucket, self._key(key))

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def open(self, key: str) -> BinaryIO:
        # deferred: boto3 only for an s3:// store
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except ClientError as exc:
            if self._not_found(exc, key):
                raise ObjectNotFound(f"{self.uri_for(key)}: no such object") from None
            raise

    def exists(self, key: str) -> bool:
        # deferred: boto3 only for an s3:// store
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if self._not_found(exc, key):
                return False
            raise

    def list(self, prefix: str = "") -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix):
            keys.extend(obj["Key"][len(base):] for obj in page.get("Contents", []))
        return sorted(keys)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def size(self, key: str) -> int:
        # deferred: boto3 only for an s3:// store
        from botocore.exceptions import ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except ClientError as exc:
            if self._not_found(exc, key):
                raise ObjectNotFound(f"{self.uri_for(key)}: no such object") from None
            raise


def open_store(uri: str | Path, *, endpoint_url: str | None = None) -> ObjectStore:
    """The store rooted at ``uri``: ``s3://bucket/prefix``, ``file:///dir`` or a directory path."""
    text = str(uri)
    if text.startswith("s3://"):
        bucket, _, prefix = text[len("s3://"):].partition("/")
        return S3Store(bucket, prefix, endpoint_url=endpoint_url)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise ObjectStoreError(f"store URI {text!r}: expected a directory, file:// or s3://bucket/prefix")
    return LocalStore(text)


def split_object_uri(uri: str | Path, *, default_name: str) -> tuple[str, str]:
    """``.../prefix/name.json`` → (``.../prefix``, ``name.json``); a URI naming a directory or
    prefix (no ``.json`` suffix) gets ``default_name`` appended."""
    text = str(uri).rstrip("/")
    if not text.endswith(".json"):
        return text, default_name
    root, _, name = text.rpartition("/")
    if text.startswith("s3://") and root in ("s3:", ""):
        raise ObjectStoreError(f"{uri!r}: expected s3://bucket/[prefix/]{default_name}")
    if not root:
        root = "/" if text.startswith("/") else "."
    return root, name
