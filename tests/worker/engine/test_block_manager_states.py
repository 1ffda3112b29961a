"""BlockAllocator under random sequences of allocate (with prefix hits), append, fork, free
(finish or preempt: the same to the allocator) and the evictions they cause: a stateful
property test. Each block's contents are modelled (the tokens written into it), so that besides
the allocator's own invariants (no leak, no double free, counts equal to the tables) it checks
what a user would see go wrong: a prefix hit that hands back blocks holding other tokens, a
write into a block another sequence still reads, a registered (immutable) block written again."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from services.common.prefix_blocks import block_hashes, reusable_blocks
from services.worker.engine.block_manager import BlockAllocator

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

BLOCK = 2
PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]  # two share their first block


class AllocatorStates(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(num_blocks=8, block_size=BLOCK)
        self.tokens: dict[int, list[int]] = {}  # each live sequence's tokens (all written)
        self.content: dict[int, list[int]] = {}  # block -> the tokens written into it, in order
        self.next_id = 0

    def _write(self, seq_id: int, position: int, token: int) -> None:
        table = self.allocator.block_table(seq_id)
        block = table[position // BLOCK]
        assert self.allocator.ref_count(block) == 1, f"block {block} is written while shared"
        assert block not in self.allocator._hash_of, f"registered block {block} is written again"
        cells = self.content.setdefault(block, [])
        del cells[position % BLOCK:]  # a block taken again is overwritten from its first slot
        cells.append(token)

    def _register_full_blocks(self, seq_id: int) -> None:
        tokens = self.tokens[seq_id]
        self.allocator.cache_blocks(seq_id, block_hashes(tokens, BLOCK))

    @rule(target=seqs, prefix=st.sampled_from(range(len(PREFIXES))), keep=st.integers(1, 6),
          suffix=st.lists(st.integers(20, 23), max_size=3))
    def admit(self, prefix: int, keep: int, suffix: list[int]):
        tokens = PREFIXES[prefix][:keep] + suffix
        hit = self.allocator.cached_prefix(block_hashes(tokens, BLOCK, limit=reusable_blocks(len(tokens), BLOCK)))
        for i, block in enumerate(hit):  # a hit holds exactly the prompt's tokens
            assert self.content[block] == tokens[i * BLOCK:(i + 1) * BLOCK], (block, self.content[block])
        if not self.allocator.can_allocate(len(tokens), hit):
            return None
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.allocator.allocate(seq_id, len(tokens), hit)
        self.tokens[seq_id] = tokens
        for position in range(len(hit) * BLOCK, len(tokens)):  # the prefill writes the rest
            self._write(seq_id, position, tokens[position])
        self._register_full_blocks(seq_id)
        return seq_id

    @rule(seq_id=seqs, token=st.integers(20, 23))
    def decode(self, seq_id, token: int) -> None:
        if seq_id is None or seq_id not in self.tokens:
            return
        position = len(self.tokens[seq_id])
        if not self.allocator.can_grow(seq_id, position + 1):
            return
        self.allocator.ensure_capacity(seq_id, position + 1)
        if self.allocator.ref_count(self.allocator.block_table(seq_id)[position // BLOCK]) > 1:
            if not self.allocator.num_free_blocks:
                return
            src, dst = self.allocator.copy_on_write(seq_id, position)
            self.content[dst] = list(self.content[src][:position % BLOCK])  # the copy the ranks make
        self._write(seq_id, position, token)
        self.tokens[seq_id].append(token)
        self._register_full_blocks(seq_id)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent is None or parent not in self.tokens:
            return None
        child, self.next_id = self.next_id, self.next_id + 1
        self.allocator.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        return child

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id) -> None:
        if seq_id is None or seq_id not in self.tokens:
            return
        self.allocator.free(seq_id)
        del self.tokens[seq_id]

    @invariant()
    def tables_hold_their_tokens(self) -> None:
        self.allocator.check_invariants()
        for seq_id, tokens in self.tokens.items():
            table = self.allocator.block_table(seq_id)
            held = [t for block in table for t in self.content.get(block, [])]
            assert held[:len(tokens)] == tokens, (seq_id, table, held, tokens)

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.allocator.free(seq_id)
        self.allocator.check_invariants()
        assert self.allocator.num_free_blocks == self.allocator.num_blocks  # nothing leaked


AllocatorStates.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_allocator_states = AllocatorStates.TestCase
