"""Paged KV-cache bookkeeping: which fixed-size blocks hold which sequence's tokens.

Pure Python (no torch): the allocator hands out block ids; the KV tensors themselves live on
every rank (``kv_cache.allocate_kv_cache``) and are indexed with the slots computed here. Every
rank of a replica group has the same number of blocks, so one allocator on the driver serves
the whole group.

Token ``position`` of a sequence lives in block ``block_table[position // block_size]`` at
offset ``position % block_size``; its flat slot (what ``AttentionMetadata.slot_mapping`` holds)
is ``block * block_size + offset``.

Invariants (checked by the property tests):

- a block is either on the free list (reference count 0) or referenced by at least one block
  table (reference count = number of tables that hold it); never both, never twice on the list;
- ``num_free_blocks + num_used_blocks == num_blocks``;
- a sequence's table has exactly ``ceil(num_tokens / block_size)`` blocks.

Blocks are handed out from the front of the free list and returned to its back, last table
entry first, so block ids are deterministic: a fresh allocator gives 0, 1, 2, ...

Prefix caching (the scheduler's, when on): a full block whose keys and values are written may be
registered under its name (``services.common.prefix_blocks.block_hash``; ``cache_blocks``). A
registered block keeps its contents when its last table lets go of it: it waits on the free
list, still findable by its name (``cached_prefix``), until a new allocation takes it from the
front (an eviction), so the free list is the LRU order of the cached blocks. A sequence's blocks
go back last entry first, so its tail, useless once its head is gone, is evicted before its
head. A hit on a block on the free list takes it back off the list. Only full blocks are ever
registered: a sequence writes only past its computed tokens, so a shared block is never written
(the partial last block of a fork is copied first, ``copy_on_write``). Free blocks, cached or
not, all count as free: an allocation may always evict. ``events`` (a :class:`PrefixCacheLog`),
when set, hears of every registration and eviction, for the routers that mirror the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.worker.engine.prefix_events import PrefixCacheLog


class BlockAllocatorError(Exception):
    """Base of the block allocator's errors."""


class OutOfBlocks(BlockAllocatorError):
    """Not enough free blocks for a request; nothing was allocated."""

    def __init__(self, needed: int, free: int, *, seq_id: int | None = None) -> None:
        self.needed = needed
        self.free = free
        self.seq_id = seq_id
        who = f" for sequence {seq_id}" if seq_id is not None else ""
        super().__init__(f"need {needed} free KV block(s){who}, have {free}")


class UnknownSequence(BlockAllocatorError, LookupError):
    """The sequence has no block table in this allocator."""


class DuplicateSequence(BlockAllocatorError, ValueError):
    """The sequence already has a block table."""


class PositionOutOfRange(BlockAllocatorError, IndexError):
    """A token position beyond the blocks a sequence holds."""


def blocks_for_tokens(n_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``n_tokens`` tokens: ``ceil(n_tokens / block_size)``."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    return -(-n_tokens // block_size)


class BlockAllocator:
    """Free list, per-sequence block tables and block reference counts, and the cached blocks
    of prefix caching (see the module docstring).

    Reference counts let several sequences share a block (``fork``, a prefix hit); a shared
    block must be copied before it is written (``copy_on_write``).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        self._cached: dict[bytes, int] = {}  # hash -> block holding that prefix
        self._hash_of: dict[int, bytes] = {}  # block -> its hash, for registered blocks
        self._registered: dict[int, int] = {}  # seq_id -> leading table entries registered or seen
        self.num_evictions = 0
        self.events: PrefixCacheLog | None = None  # told of every registration and eviction

    # ---- counters ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def used_tokens_capacity(self) -> int:
        """Token slots in blocks that are in use (including the unfilled tail of last blocks)."""
        return self.num_used_blocks * self.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_sequences(self) -> int:
        return len(self._tables)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by a prefix hash, in tables or on the free list."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_tokens(self, seq_id: int) -> int:
        """Tokens the sequence has claimed slots for."""
        self._require(seq_id)
        return self._num_tokens[seq_id]

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._require(seq_id))

    # ---- queries ----------------------------------------------------------------------

    def blocks_needed(self, n_tokens: int) -> int:
        return blocks_for_tokens(n_tokens, self.block_size)

    def can_allocate(self, n_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Whether a new sequence of ``n_tokens`` tokens would fit now, its first blocks the
        cached ``prefix`` (which may themselves be on the free list)."""
        return self._new_blocks(n_tokens, prefix) <= self._free_beside(prefix)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest run of ``hashes`` from the first (a prefix hit)."""
        blocks = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def blocks_to_grow(self, seq_id: int, total_tokens: int) -> int:
        """New blocks ``ensure_capacity(seq_id, total_tokens)`` would take (0 if it fits)."""
        table = self._require(seq_id)
        return max(0, self.blocks_needed(total_tokens) - len(table))

    def can_grow(self, seq_id: int, total_tokens: int) -> bool:
        return self.blocks_to_grow(seq_id, total_tokens) <= len(self._free)

    # ---- mutation ---------------------------------------------------------------------

    def allocate(self, seq_id: int, n_tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        """Create ``seq_id``'s table with room for ``n_tokens`` tokens; returns a copy of it.
        ``prefix``: cached blocks (``cached_prefix``) that start the table, shared.

        Raises ``DuplicateSequence`` if it already has one, ``OutOfBlocks`` (allocating
        nothing) if the free list is too short.
        """
        if seq_id in self._tables:
            raise DuplicateSequence(f"sequence {seq_id} already holds blocks {self._tables[seq_id]}")
        needed, free = self._new_blocks(n_tokens, prefix), self._free_beside(prefix)
        if needed > free:
            raise OutOfBlocks(needed, free, seq_id=seq_id)
        for block in prefix:
            assert block in self._hash_of, f"block {block} is not a cached block"
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        self._tables[seq_id] = list(prefix) + self._take(needed)
        self._num_tokens[seq_id] = n_tokens
        self._registered[seq_id] = len(prefix)
        return list(self._tables[seq_id])

    def cache_blocks(self, seq_id: int, hashes: Sequence[bytes]) -> int:
        """Register ``seq_id``'s leading full blocks under ``hashes`` (one per block, from the
        first; their keys and values written, or written by a step already scheduled: each rank
        runs steps in order). A block whose hash another block already holds stays unregistered
        (two sequences computed the same prefix at once). Returns the blocks newly registered."""
        table = self._require(seq_id)
        if len(hashes) > self._num_tokens[seq_id] // self.block_size:
            raise PositionOutOfRange(f"sequence {seq_id} has {self._num_tokens[seq_id] // self.block_size} full "
                                     f"block(s), not {len(hashes)}")
        added = 0
        for index in range(self._registered[seq_id], len(hashes)):
            block, h = table[index], hashes[index]
            if block not in self._hash_of and h not in self._cached:
                self._cached[h] = block
                self._hash_of[block] = h
                added += 1
                if self.events is not None:
                    self.events.stored(h)
        self._registered[seq_id] = max(self._registered[seq_id], len(hashes))
        return added

    def ensure_capacity(self, seq_id: int, total_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``total_tokens`` tokens; returns the new block ids.

        Never shrinks. All or nothing: on ``OutOfBlocks`` the table is unchanged.
        """
        table = self._require(seq_id)
        needed = self.blocks_to_grow(seq_id, total_tokens)
        if needed > len(self._free):
            raise OutOfBlocks(needed, len(self._free), seq_id=seq_id)
        new = self._take(needed)
        table.extend(new)
        self._num_tokens[seq_id] = max(self._num_tokens[seq_id], total_tokens)
        return new

    def append_slot(self, seq_id: int) -> int:
        """Claim the slot for the sequence's next token (growing the table when the token
        starts a new block) and return that flat slot."""
        position = self.num_tokens(seq_id)
        self.ensure_capacity(seq_id, position + 1)
        return self.slot(seq_id, position)

    def slot(self, seq_id: int, position: int) -> int:
        """Flat slot of token ``position``: ``block_table[position // bs] * bs + position % bs``."""
        table = self._require(seq_id)
        index, offset = divmod(position, self.block_size)
        if position < 0 or index >= len(table):
            raise PositionOutOfRange(
                f"position {position} of sequence {seq_id} is outside its {len(table)} block(s) "
                f"(valid 0..{len(table) * self.block_size - 1})")
        return table[index] * self.block_size + offset

    def slots(self, seq_id: int, start: int, stop: int) -> list[int]:
        """Flat slots of positions ``start..stop-1``."""
        return [self.slot(seq_id, p) for p in range(start, stop)]

    def free(self, seq_id: int) -> int:
        """Drop ``seq_id``'s table; blocks whose count reaches 0 go back to the free list (in
        table order). Returns the number of blocks returned to the free list."""
        table = self._require(seq_id)
        del self._tables[seq_id]
        del self._num_tokens[seq_id]
        del self._registered[seq_id]
        returned = 0
        for block in reversed(table):
            returned += self._release(block)
        return returned

    def fork(self, parent_id: int, child_id: int) -> list[int]:
        """Give ``child_id`` the parent's blocks, shared (each block's count + 1)."""
        table = self._require(parent_id)
        if child_id in self._tables:
            raise DuplicateSequence(f"sequence {child_id} already holds blocks {self._tables[child_id]}")
        for block in table:
            self._ref_counts[block] += 1
        self._tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        self._registered[child_id] = self._registered[parent_id]
        return list(table)

    def copy_on_write(self, seq_id: int, position: int) -> tuple[int, int] | None:
        """Before writing token ``position`` of ``seq_id``: if its block is shared, give the
        sequence a private block in its place and return ``(src, dst)`` — the caller must copy
        the KV contents of block ``src`` into ``dst`` on every rank. ``None`` if not shared."""
        table = self._require(seq_id)
        self.slot(seq_id, position)  # validates the position
        index = position // self.block_size
        src = table[index]
        if self._ref_counts[src] == 1:
            return None
        if not self._free:
            raise OutOfBlocks(1, 0, seq_id=seq_id)
        (dst,) = self._take(1)
        table[index] = dst
        self._release(src)
        return src, dst

    # ---- internals --------------------------------------------------------------------

    def _require(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id} holds no KV blocks") from None

    def _new_blocks(self, n_tokens: int, prefix: Sequence[int]) -> int:
        return max(0, self.blocks_needed(n_tokens) - len(prefix))

    def _free_beside(self, prefix: Sequence[int]) -> int:
        """Free blocks left for new ones once ``prefix``'s blocks on the free list are taken."""
        return len(self._free) - sum(1 for block in prefix if self._ref_counts[block] == 0)

    def _take(self, n: int) -> list[int]:
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block in blocks:
            assert self._ref_counts[block] == 0, f"block {block} on the free list has refs"
            self._ref_counts[block] = 1
            h = self._hash_of.pop(block, None)
            if h is not None:  # the least recently used cached block: its prefix is gone
                del self._cached[h]
                self.num_evictions += 1
                if self.events is not None:
                    self.events.removed(h)
        return blocks

    def _release(self, block: int) -> int:
        """Drop one reference; returns 1 if the block went back to the free list."""
        count = self._ref_counts[block]
        assert count > 0, f"block {block} released with reference count {count}"
        self._ref_counts[block] = count - 1
        if count == 1:
            self._free[block] = None
            return 1
        return 0

    def check_invariants(self) -> None:
        """Assert the module-level invariants (for tests and debugging; O(num_blocks))."""
        free = list(self._free)
        assert len(free) == len(set(free)), f"free list has duplicates: {free}"
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_needed(self._num_tokens[seq_id]), (seq_id, table)
            for block in table:
                counts[block] += 1
        assert counts == self._ref_counts, f"reference counts {self._ref_counts} != tables {counts}"
        for block in free:
            assert counts[block] == 0, f"free block {block} is referenced {counts[block]} time(s)"
        assert len(free) + sum(1 for c in counts if c) == self.num_blocks
        assert {b: h for h, b in self._cached.items()} == self._hash_of, "hash maps disagree"
        assert set(self._registered) == set(self._tables)
