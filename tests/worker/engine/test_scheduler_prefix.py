"""Scheduler with prefix caching: a prompt's cached blocks are taken, not prefilled again, each
step still reads its own prefix under preemption and eviction, and salts keep requests apart."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.sampling import SamplingParams
from services.worker.engine.sequence import Sequence
from tests.worker.engine.test_scheduler import alone, chunks, make, run_to_completion, seq

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 10), st.integers(0, 2)),
                    min_size=1, max_size=10),
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    pp=st.integers(1, 3),
)
def test_prefix_hits_read_their_own_prefix_under_pressure(shapes: list[tuple[int, int, int, int]], num_blocks: int,
                                                         block_size: int, budget: int, max_num_seqs: int,
                                                         pp: int) -> None:
    """Prompts made of a few shared prefixes (one of 4, 0-3 blocks' worth of a longer one), a
    suffix and a salt (0: none); caching on: the outputs are those of each sequence alone, every
    step reads its own prefix, and the blocks all come back."""
    capacity = num_blocks * block_size
    seqs = []
    for i, (prefix, blocks, suffix, salt) in enumerate(shapes):
        prompt = [10 + prefix] * (block_size * (blocks + 1)) + [50 + i] * suffix
        if len(prompt) + 5 - 1 <= capacity:
            seqs.append(Sequence(i, prompt, SamplingParams(max_tokens=5, cache_salt=str(salt) if salt else None)))
    expected = alone(seqs)
    s = make(num_blocks, block_size, max_num_seqs=max_num_seqs, max_batched_tokens=budget, max_model_len=1000,
             prefix_caching=True)
    assert run_to_completion(s, seqs, pp=pp) == expected
    assert s.allocator.num_free_blocks == num_blocks
    assert s.prefix_cache_hits <= s.prefix_cache_queries
    assert not s.has_unfinished and not s.in_flight


def test_a_shared_prefix_is_prefilled_once() -> None:
    s = make(num_blocks=16, block_size=4, prefix_caching=True)
    system = list(range(10, 22))  # 3 full blocks
    s.add(Sequence(0, system + [7, 8], SamplingParams(max_tokens=2)))
    out = s.schedule()
    assert chunks(out) == [(0, list(range(14)), list(range(14)), [0, 1, 2, 3], True, 14)]
    s.on_step_done({0: 5})
    # the second request takes the three full blocks and prefills its own 2 tokens only
    s.add(Sequence(1, system + [9, 9], SamplingParams(max_tokens=2)))
    out = s.schedule()
    assert chunks(out) == [(0, [14], [14], [0, 1, 2, 3], True, 15),
                           (1, [12, 13], [16, 17], [0, 1, 2, 4], True, 14)]
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (14 + 14, 12)
    assert [s.allocator.ref_count(b) for b in (0, 1, 2, 3, 4)] == [2, 2, 2, 1, 1]
    s.on_step_done({0: 6, 1: 6})  # seq 0 finishes; its blocks stay cached on the free list
    # a prompt that is exactly the cached blocks still runs its last token (its logits are sampled):
    # the hit stops a block short, and the last block is prefilled into a new one
    s.add(Sequence(2, list(system), SamplingParams(max_tokens=1)))
    out = s.schedule()
    assert [(c.seq_id, c.positions, c.block_table[:2]) for c in out.scheduled] == [
        (1, [14], [0, 1]), (2, [8, 9, 10, 11], [0, 1])]
    assert s.prefix_cache_hits == 12 + 8


def test_a_preempted_sequence_finds_its_own_blocks_and_salts_keep_requests_apart() -> None:
    s = make(num_blocks=4, block_size=2, prefix_caching=True)
    a, b = seq(0, 3, max_tokens=3), seq(1, 3, max_tokens=3)
    s.add(a)
    s.add(b)
    s.schedule()
    s.on_step_done({0: 10, 1: 20})
    s.schedule()
    s.on_step_done({0: 11, 1: 21})
    assert s.schedule().preempted == [1]  # b's 2 full blocks are cached; its last one is taken by a
    s.on_step_done({0: 12})
    out = s.schedule()  # b: 5 tokens; its first block is still cached, its second was evicted
    assert [(c.seq_id, c.positions) for c in out.scheduled] == [(1, [2, 3, 4])]
    # b's second block went to a; b's new blocks are a's partial last block and a's second (a's tail
    # before its head: a's first block stays cached)
    assert s.allocator.num_evictions == 2
    s.on_step_done({1: 22})
    # a's first block, the least recently used, is at the front of the free list: the unsalted
    # request comes first, so that the salted one's new blocks do not evict it
    s.add(Sequence(2, list(a.prompt_token_ids), SamplingParams(max_tokens=1)))
    s.add(Sequence(3, list(a.prompt_token_ids), SamplingParams(max_tokens=1, cache_salt="tenant-b")))
    out = s.schedule()
    assert [(c.seq_id, c.positions) for c in out.scheduled] == [(2, [2]), (3, [0, 1, 2])]


def test_without_prefix_caching_every_prompt_is_prefilled() -> None:
    s = make(num_blocks=16, block_size=4)
    for sid in range(2):
        s.add(Sequence(sid, list(range(10, 22)) + [sid], SamplingParams(max_tokens=1)))
        out = s.schedule()
        assert out.scheduled[0].positions == list(range(13))
        s.on_step_done({sid: 5})
    assert s.allocator.num_cached_blocks == 0 and s.prefix_cache_queries == 0
