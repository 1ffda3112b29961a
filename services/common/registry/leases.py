"""Leadership leases in the registry, and the fence that keeps a deposed holder from writing.

A lease is taken by compare-and-set on what its taker read: (holder, term, renewals). The holder
renews it by adding one to ``renewals``; an observer that sees the same triple for the lease's
TTL on its own clock takes it over with the next term (no two hosts' clocks are compared, as a
Kubernetes lease's observers do). A registry opened with ``fence=(name, term)`` checks, inside
every transaction, that the lease is still in that term, and refuses the transaction otherwise:
a holder that was paused past its TTL (SIGSTOP, a long GC, a partition) and wakes up believing
it still leads cannot write a thing. On PostgreSQL the check holds the lease row (FOR SHARE), so
a takeover waits for the fenced transaction to finish and the order of terms holds; a fenced
transaction that stalls (its holder paused inside it) is ended by the server after a second
(``ShardRegistry.fenced``), so the takeover waits that long, not forever.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

from sqlalchemy import func, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from . import errors
from .models import LeaseRow

TAKE_WAIT_S = 2.0  # how long a taker waits for a holder's transaction on the lease row (PostgreSQL)


@dataclass(frozen=True)
class Lease:
    name: str
    holder: str  # "" once released
    term: int
    renewals: int
    ttl_s: float

    @property
    def seen(self) -> tuple[str, int, int]:
        """What an observer times: unchanged for ``ttl_s`` means the holder stopped renewing."""
        return self.holder, self.term, self.renewals


class Fenced(errors.RegistryError):
    """A write under a lease term that is no longer the lease's: another holder has it now."""

    def __init__(self, name: str, term: int, current: int | None) -> None:
        self.name, self.term, self.current = name, term, current
        now = f"term {current}" if current is not None else "no lease"
        super().__init__(f"lease {name!r}: fenced out, this holder's term {term} is over ({now} now)")


def check_fence(session: Session, name: str, term: int) -> None:
    """Raise :class:`Fenced` unless lease ``name`` is in ``term`` (its row held to the end of the
    transaction where the database can: PostgreSQL)."""
    query = select(LeaseRow.term).where(LeaseRow.name == name)
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(read=True)
    current = session.execute(query).scalar_one_or_none()
    if current != term:
        raise Fenced(name, term, current)


def _lease(row: LeaseRow) -> Lease:
    return Lease(row.name, row.holder, row.term, row.renewals, row.ttl_s)


class LeaseRecords:
    """Reading, taking, renewing and releasing leases (a mixin of ShardRegistry)."""

    def _tx(self) -> AbstractContextManager[Session]:  # provided by ShardRegistry
        raise NotImplementedError

    def read_lease(self, name: str) -> Lease | None:
        with self._tx() as session:
            row = session.get(LeaseRow, name)
            return _lease(row) if row is not None else None

    def take_lease(self, name: str, holder: str, ttl_s: float, *, seen: Lease | None) -> Lease | None:
        """Hold lease ``name`` from now, in the term after ``seen``'s (the first term when there is
        none yet); None when someone else changed it since ``seen`` was read."""
        if not holder or ttl_s <= 0:
            raise errors.InvalidValue(f"a lease needs a holder and a positive TTL, got {holder!r}, {ttl_s!r}")
        try:
            with self._tx() as session:
                if session.get_bind().dialect.name == "postgresql":
                    # a holder's fenced transaction holds the row while it runs (or until the server
                    # ends it, if the holder stalled in it): wait that long at most, then try again later
                    session.execute(text(f"SET LOCAL lock_timeout = {int(TAKE_WAIT_S * 1000)}"))
                if seen is None:
                    session.add(LeaseRow(name=name, holder=holder, term=1, renewals=0, ttl_s=ttl_s))
                    session.flush()
                    return Lease(name, holder, 1, 0, ttl_s)
                taken = session.execute(
                    update(LeaseRow)
                    .where(LeaseRow.name == name, LeaseRow.holder == seen.holder, LeaseRow.term == seen.term,
                           LeaseRow.renewals == seen.renewals)
                    .values(holder=holder, term=seen.term + 1, renewals=0, ttl_s=ttl_s))
                return Lease(name, holder, seen.term + 1, 0, ttl_s) if taken.rowcount == 1 else None
        except IntegrityError:  # another taker made the first term first
            return None
        except OperationalError as exc:  # the row stayed locked past TAKE_WAIT_S
            if "lock timeout" not in str(exc):
                raise
            return None

    def renew_lease(self, lease: Lease) -> Lease | None:
        """One more renewal of a lease this holder holds; None when it no longer does."""
        with self._tx() as session:
            renewed = session.execute(
                update(LeaseRow)
                .where(LeaseRow.name == lease.name, LeaseRow.holder == lease.holder, LeaseRow.term == lease.term)
                .values(renewals=LeaseRow.renewals + 1, renewed_at=func.now()))
            if renewed.rowcount != 1:
                return None
        return Lease(lease.name, lease.holder, lease.term, lease.renewals + 1, lease.ttl_s)

    def release_lease(self, lease: Lease) -> bool:
        """Give the lease up (a clean stop): the next observer takes it without waiting its TTL."""
        with self._tx() as session:
            released = session.execute(
                update(LeaseRow)
                .where(LeaseRow.name == lease.name, LeaseRow.holder == lease.holder, LeaseRow.term == lease.term)
                .values(holder=""))
            return released.rowcount == 1
