"""BlockAllocator: exact block ids, growth at block boundaries, ref counts, and a state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.common.prefix_blocks import block_hash
from services.worker.engine.block_manager import (
    BlockAllocator,
    DuplicateSequence,
    OutOfBlocks,
    PositionOutOfRange,
    UnknownSequence,
    blocks_for_tokens,
)

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


def test_blocks_for_tokens_is_ceil() -> None:
    assert [blocks_for_tokens(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_allocate_hands_out_lowest_ids_in_order() -> None:
    a = BlockAllocator(num_blocks=8, block_size=4)
    assert a.allocate(seq_id=1, n_tokens=5) == [0, 1]
    assert a.allocate(seq_id=2, n_tokens=4) == [2]
    assert a.allocate(seq_id=3, n_tokens=9) == [3, 4, 5]
    assert a.block_table(1) == [0, 1]
    assert (a.num_free_blocks, a.num_used_blocks, a.used_tokens_capacity) == (2, 6, 24)
    assert [a.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 1, 0, 0]
    a.check_invariants()


def test_slots_are_block_times_block_size_plus_offset() -> None:
    a = BlockAllocator(num_blocks=8, block_size=4)
    a.allocate(1, 3)  # block 0
    a.allocate(2, 6)  # blocks 1, 2
    assert a.slots(2, 0, 6) == [4, 5, 6, 7, 8, 9]
    assert a.slot(1, 2) == 2
    with pytest.raises(PositionOutOfRange, match="position 8 of sequence 2 is outside its 2 block"):
        a.slot(2, 8)
    with pytest.raises(PositionOutOfRange):
        a.slot(2, -1)


def test_append_slot_grows_exactly_at_block_boundary() -> None:
    a = BlockAllocator(num_blocks=4, block_size=4)
    a.allocate(7, 3)
    assert a.append_slot(7) == 3  # position 3 still fits block 0
    assert a.block_table(7) == [0]
    assert a.append_slot(7) == 4  # position 4 starts block 1
    assert a.block_table(7) == [0, 1]
    assert a.num_tokens(7) == 5
    a.check_invariants()


def test_ensure_capacity_returns_only_new_blocks_and_never_shrinks() -> None:
    a = BlockAllocator(num_blocks=6, block_size=2)
    a.allocate(1, 1)
    assert a.ensure_capacity(1, 2) == []
    assert a.ensure_capacity(1, 7) == [1, 2, 3]
    assert a.ensure_capacity(1, 3) == []
    assert a.block_table(1) == [0, 1, 2, 3]
    assert a.num_tokens(1) == 7


def test_out_of_blocks_names_the_numbers_and_allocates_nothing() -> None:
    a = BlockAllocator(num_blocks=3, block_size=4)
    a.allocate(1, 8)
    assert not a.can_allocate(5)
    with pytest.raises(OutOfBlocks, match=r"need 2 free KV block\(s\) for sequence 2, have 1") as err:
        a.allocate(2, 5)
    assert (err.value.needed, err.value.free) == (2, 1)
    assert 2 not in a and a.num_free_blocks == 1
    with pytest.raises(OutOfBlocks, match="need 2 free"):
        a.ensure_capacity(1, 16)
    assert a.block_table(1) == [0, 1] and a.num_tokens(1) == 8
    assert a.can_grow(1, 12) and not a.can_grow(1, 13)


def test_free_returns_blocks_to_back_of_free_list_last_entry_first() -> None:
    a = BlockAllocator(num_blocks=5, block_size=1)
    a.allocate(1, 2)  # 0, 1
    a.allocate(2, 2)  # 2, 3
    assert a.free(1) == 2
    assert a.num_free_blocks == 3
    # free list is now [4, 1, 0]: a sequence's tail is evicted before its head
    assert a.allocate(3, 3) == [4, 1, 0]
    with pytest.raises(UnknownSequence, match="sequence 1 holds no KV blocks"):
        a.free(1)
    a.check_invariants()


def test_duplicate_allocate_is_rejected() -> None:
    a = BlockAllocator(num_blocks=4, block_size=4)
    a.allocate(1, 1)
    with pytest.raises(DuplicateSequence, match=r"sequence 1 already holds blocks \[0\]"):
        a.allocate(1, 1)


def test_fork_shares_blocks_and_counts_references() -> None:
    a = BlockAllocator(num_blocks=6, block_size=4)
    a.allocate(1, 6)  # 0, 1
    assert a.fork(1, 2) == [0, 1]
    assert [a.ref_count(0), a.ref_count(1)] == [2, 2]
    assert a.num_used_blocks == 2
    # the child grows privately
    assert a.ensure_capacity(2, 9) == [2]
    assert a.free(1) == 0  # still referenced by 2
    assert [a.ref_count(0), a.ref_count(1), a.ref_count(2)] == [1, 1, 1]
    assert a.free(2) == 3
    assert a.num_free_blocks == 6
    a.check_invariants()


def test_copy_on_write_replaces_a_shared_block() -> None:
    a = BlockAllocator(num_blocks=4, block_size=4)
    a.allocate(1, 6)  # 0, 1 (block 1 half full)
    a.fork(1, 2)
    assert a.copy_on_write(2, 5) == (1, 2)
    assert a.block_table(2) == [0, 2]
    assert a.block_table(1) == [0, 1]
    assert [a.ref_count(b) for b in range(4)] == [2, 1, 1, 0]
    assert a.copy_on_write(2, 5) is None  # now private
    assert a.copy_on_write(1, 4) is None  # block 1 is no longer shared
    a.check_invariants()


def test_block_hash_chains_parents_and_salts_only_the_first_block() -> None:
    first = block_hash(None, [1, 2, 3])
    assert first == block_hash(None, [1, 2, 3]) and len(first) == 16
    assert first != block_hash(None, [1, 2, 4]) and first != block_hash(None, [1, 2, 3], "tenant-a")
    assert block_hash(first, [4, 5, 6]) != block_hash(block_hash(None, [9, 2, 3]), [4, 5, 6])
    assert block_hash(first, [4, 5, 6], "ignored") == block_hash(first, [4, 5, 6])


def test_cached_blocks_survive_free_until_evicted_least_recently_used_first() -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    h = [block_hash(None, [1, 2])]
    h.append(block_hash(h[0], [3, 4]))
    a.allocate(1, 5)  # blocks 0, 1 full, 2 partial
    assert a.cache_blocks(1, h) == 2 and a.num_cached_blocks == 2
    assert a.cached_prefix(h + [block_hash(h[1], [5, 6])]) == [0, 1]
    a.free(1)  # free list [3, 2, 1, 0]: all free, 0 and 1 still cached
    assert a.num_free_blocks == 4 and a.cached_prefix(h) == [0, 1]
    # a hit takes block 0 off the free list; the other new blocks come from the front
    assert not a.can_allocate(2 + 8, [0]) and a.can_allocate(2 + 6, [0])
    assert a.allocate(2, 2 + 5, [0]) == [0, 3, 2, 1]
    assert a.num_evictions == 1 and a.cached_prefix(h) == [0]  # block 1 was taken: its prefix is gone
    assert a.ref_count(0) == 1
    a.allocate(3, 2, [0])  # a second sequence shares block 0, and needs no other
    assert a.ref_count(0) == 2 and a.block_table(3)[0] == 0
    with pytest.raises(OutOfBlocks, match="need 1 free KV block"):
        a.allocate(4, 3, [0])
    a.check_invariants()


def test_a_hash_already_cached_is_not_registered_twice() -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    h = [block_hash(None, [7, 7])]
    a.allocate(1, 2)
    a.allocate(2, 2)  # the same prompt, computed side by side
    assert a.cache_blocks(1, h) == 1 and a.cache_blocks(2, h) == 0
    assert a.cached_prefix(h) == a.block_table(1)
    with pytest.raises(PositionOutOfRange, match="has 1 full block"):
        a.cache_blocks(1, h * 2)
    a.check_invariants()


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        BlockAllocator(0, 16)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        BlockAllocator(4, 0)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / grow / append / fork / copy-on-write / free / register / prefix-hit
    sequences against a simple model: no block leaks or is freed twice (``check_invariants``),
    a block newly taken from the free list is in no other table and has lost its hash (its
    contents are overwritten), and a prefix hit only returns blocks registered under the hashes
    asked for and not handed out since."""

    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(num_blocks=12, block_size=3)
        self.tokens: dict[int, int] = {}
        self.next_id = 0
        self.contents: dict[int, list[int]] = {}  # seq -> the value of each full block it registers
        self.registered: dict[int, bytes] = {}  # block -> the hash it was registered under
        self.tables: dict[int, list[int]] = {}  # every table after the last rule
        self.shared: set[tuple[int, int]] = set()  # (seq, index) placed by a fork or a hit in the last rule

    @rule(n=st.integers(0, 20))
    def allocate(self, n: int) -> None:
        free = self.a.num_free_blocks
        if self.a.can_allocate(n):
            table = self.a.allocate(self.next_id, n)
            assert len(table) == blocks_for_tokens(n, 3)
            assert self.a.num_free_blocks == free - len(table)
            self.tokens[self.next_id] = n
        else:
            with pytest.raises(OutOfBlocks):
                self.a.allocate(self.next_id, n)
            assert self.a.num_free_blocks == free
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 10))
    def grow(self, data: st.DataObject, extra: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        target = self.tokens[seq] + extra
        if self.a.can_grow(seq, target):
            self.a.ensure_capacity(seq, target)
            self.tokens[seq] = target
        else:
            before = self.a.block_table(seq)
            with pytest.raises(OutOfBlocks):
                self.a.ensure_capacity(seq, target)
            assert self.a.block_table(seq) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.a.can_grow(seq, self.tokens[seq] + 1):
            slot = self.a.append_slot(seq)
            pos = self.tokens[seq]
            assert slot == self.a.block_table(seq)[pos // 3] * 3 + pos % 3
            self.tokens[seq] += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        used = self.a.num_used_blocks
        self.a.fork(seq, self.next_id)
        assert self.a.num_used_blocks == used
        self.tokens[self.next_id] = self.tokens[seq]
        self.contents[self.next_id] = list(self.contents.get(seq, []))
        self.shared |= {(self.next_id, index) for index in range(len(self.a.block_table(seq)))}
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cow(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.tokens[seq] and self.a.num_free_blocks:
            self.a.copy_on_write(seq, self.tokens[seq] - 1)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        """Register a sequence's full blocks, each under its contents' hash (ids drawn from a
        small range, so that other sequences ask for the same prefixes)."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        full = self.tokens[seq] // 3
        contents = self.contents.setdefault(seq, [])
        contents.extend(data.draw(st.integers(0, 2)) for _ in range(len(contents), full))
        hashes = self._hashes(contents[:full])
        self.a.cache_blocks(seq, hashes)
        for block, h in zip(self.a.block_table(seq), hashes, strict=False):
            if self.a.cached_prefix([h]) == [block]:
                self.registered[block] = h

    @rule(data=st.data(), n=st.integers(1, 20))
    def allocate_with_prefix(self, data: st.DataObject, n: int) -> None:
        """A new sequence whose first blocks are asked for by their hashes: it gets the longest
        cached run, and each block it gets holds what was cached under that hash."""
        wanted = [data.draw(st.integers(0, 2)) for _ in range(n // 3)]
        prefix = self.a.cached_prefix(self._hashes(wanted))
        hashes = self._hashes(wanted)
        for block, h in zip(prefix, hashes, strict=False):
            assert self.registered.get(block) == h, "a prefix hit on a block with other contents"
        if self.a.can_allocate(n, prefix):
            table = self.a.allocate(self.next_id, n, prefix)
            assert table[:len(prefix)] == prefix and len(table) == blocks_for_tokens(n, 3)
            self.tokens[self.next_id] = n
            self.contents[self.next_id] = wanted[:len(prefix)]
            self.shared |= {(self.next_id, index) for index in range(len(prefix))}
        else:
            with pytest.raises(OutOfBlocks):
                self.a.allocate(self.next_id, n, prefix)
        self.next_id += 1

    @staticmethod
    def _hashes(values: list[int]) -> list[bytes]:
        hashes: list[bytes] = []
        for value in values:
            hashes.append(block_hash(hashes[-1] if hashes else None, [value] * 3))
        return hashes

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.a.free(seq)
        del self.tokens[seq]
        self.contents.pop(seq, None)

    @invariant()
    def consistent(self) -> None:
        self.a.check_invariants()
        tables = {seq: self.a.block_table(seq) for seq in self.tokens}
        for seq, table in tables.items():
            before = self.tables.get(seq, [])
            for index, block in enumerate(table):
                if (index >= len(before) or before[index] != block) and (seq, index) not in self.shared:
                    # taken from the free list: nobody else's, and whatever it cached is gone
                    assert self.a.ref_count(block) == 1, f"new block {block} is shared"
                    assert block not in self.registered or self.a.cached_prefix([self.registered[block]]) != [block]
                    self.registered.pop(block, None)
        self.tables, self.shared = tables, set()
        assert self.a.num_free_blocks + self.a.num_used_blocks == 12
        for seq, n in self.tokens.items():
            assert self.a.num_tokens(seq) == n
        # private (unshared) blocks are never in two tables
        owners: dict[int, list[int]] = {}
        for seq in self.tokens:
            for b in self.a.block_table(seq):
                owners.setdefault(b, []).append(seq)
        for b, seqs in owners.items():
            assert self.a.ref_count(b) == len(seqs)
        if not self.tokens:
            assert self.a.num_free_blocks == 12


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
