"""Domain errors of the shard registry; every one names what was expected and what was found."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

from sqlalchemy.exc import OperationalError

from services.common import errors as client


class RegistryError(Exception):
    """Base class of every error the shard registry raises."""


class InvalidValue(RegistryError, ValueError):
    """An argument is out of its domain (bad dtype, rank beyond the degree, negative bytes...)."""


class NotFound(RegistryError, LookupError):
    """A replica group, shard or manifest id that the registry does not hold."""

    def __init__(self, kind: str, key: object) -> None:
        self.kind = kind
        self.key = key
        super().__init__(f"{kind} {key!s} not found in the shard registry")


class GroupNotFound(NotFound):
    def __init__(self, replica_group_id: object) -> None:
        super().__init__("replica group", replica_group_id)


class ShardNotFound(NotFound):
    def __init__(self, gpu_id: str) -> None:
        super().__init__("gpu shard", gpu_id)


class ManifestNotFound(NotFound):
    def __init__(self, key: object) -> None:
        super().__init__("checkpoint manifest", key)


class Conflict(RegistryError):
    """A write that would break a uniqueness rule of the registry."""


class DuplicateShard(Conflict):
    """(replica_group_id, tp_rank, pp_stage) already has a shard, or the GPU serves a live group."""


class DuplicateManifest(Conflict):
    """A manifest with the same manifest_uri is already registered."""


class IllegalTransition(RegistryError):
    """A replica-group status change the lifecycle does not allow."""

    def __init__(self, replica_group_id: object, from_status: str, to_status: str,
                 allowed: Iterable[str]) -> None:
        self.replica_group_id = replica_group_id
        self.from_status = from_status
        self.to_status = to_status
        self.allowed = tuple(allowed)
        targets = ", ".join(self.allowed) if self.allowed else "none (terminal state)"
        super().__init__(
            f"illegal replica group transition {from_status} -> {to_status} for {replica_group_id}: "
            f"from {from_status} the allowed targets are {targets}"
        )


@contextmanager
def as_client_errors(where: str = "shard registry",
                     translate: Mapping[type[RegistryError], type[client.ShardlineError]] | None = None,
                     ) -> Iterator[None]:
    """Registry errors inside the block as the errors a client is shown: a database that cannot
    be reached is Unavailable (naming ``where``), a bad value InvalidArgument, and each class in
    ``translate`` (checked in order) the client error it maps to; anything else passes."""
    try:
        yield
    except OperationalError as exc:
        raise client.Unavailable(f"{where} is unreachable: {exc.orig}") from exc
    except RegistryError as exc:
        for source, target in (translate or {}).items():
            if isinstance(exc, source):
                raise target(str(exc)) from exc
        if isinstance(exc, InvalidValue):
            raise client.InvalidArgument(str(exc)) from exc
        raise
