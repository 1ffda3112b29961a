"""The prefix-cache event log a router mirrors: events after a cursor, snapshots for a new or
lost reader, and the allocator telling it of registrations and evictions."""

from __future__ import annotations

from services.common.prefix_blocks import block_hashes
from services.worker.engine.block_manager import BlockAllocator
from services.worker.engine.prefix_events import PrefixCacheLog


def mirror(log: PrefixCacheLog, epoch: str = "", seq: int = 0, blocks: set[bytes] | None = None):
    read = log.read(epoch, seq)
    blocks = set() if read.snapshot or blocks is None else set(blocks)
    for name, removed in read.events:
        (blocks.discard if removed else blocks.add)(name)
    return read, blocks


def test_a_reader_gets_a_snapshot_then_the_events_after_its_cursor() -> None:
    log = PrefixCacheLog(capacity=4)
    log.stored(b"a")
    log.stored(b"b")
    read, blocks = mirror(log)
    assert read.snapshot and blocks == {b"a", b"b"} and read.seq == 2
    log.removed(b"a")
    log.stored(b"c")
    read, blocks = mirror(log, read.epoch, read.seq, blocks)
    assert not read.snapshot and read.events == [(b"a", True), (b"c", False)] and blocks == {b"b", b"c"}
    assert mirror(log, read.epoch, read.seq, blocks)[0].events == []  # nothing new
    for name in (b"d", b"e", b"f", b"g", b"h"):  # more than the 4 kept: a reader that far behind
        log.stored(name)
    read, blocks = mirror(log, read.epoch, read.seq, blocks)
    assert read.snapshot and blocks == {b"b", b"c", b"d", b"e", b"f", b"g", b"h"}
    assert mirror(log, "another-epoch", read.seq)[0].snapshot  # the worker restarted


def test_the_allocator_logs_registrations_and_evictions() -> None:
    a = BlockAllocator(num_blocks=2, block_size=2)
    a.events = log = PrefixCacheLog()
    names = block_hashes([1, 2, 3, 4], 2)
    a.allocate(1, 4)
    a.cache_blocks(1, names)
    a.free(1)
    a.allocate(2, 2)  # takes block 1 from the front (the tail first): its name is evicted
    read, blocks = mirror(log)
    assert blocks == {names[0]} and log.read(read.epoch, 0).events == [
        (names[0], False), (names[1], False), (names[1], True)]
