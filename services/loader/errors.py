"""What the loader raises. Every message names the expected and the actual value.

The gRPC layer maps these through their bases (``services.common.errors``): a malformed manifest
is INVALID_ARGUMENT, a shard that does not fit the plan or the manifest FAILED_PRECONDITION, a
missing object NOT_FOUND.
"""

from __future__ import annotations

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound


class ManifestError(InvalidArgument):
    """manifest.json is malformed: missing fields, unsafe shard names, ranks missing or repeated."""


class ShardLayoutError(FailedPrecondition):
    """A checkpoint shard does not match the plan the worker runs, its manifest, or the model
    (tp, pp, dtype, rank, layer range, fingerprint, tensor names/shapes/dtypes, size, sha256)."""


class ShardChecksumError(ShardLayoutError):
    """A shard's bytes (size or sha256) differ from the manifest, after every download attempt."""


class ObjectNotFound(NotFound, FileNotFoundError):
    """No object under that key in the object store."""
