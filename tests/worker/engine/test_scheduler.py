"""Scheduler: exact admission, chunking, decode batching, preemption, abort and micro-batches."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.sampling import FinishReason, InvalidRequest, SamplingParams
from services.worker.engine.batch import flatten
from services.worker.engine.block_manager import BlockAllocator
from services.worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerError, SchedulerOutput
from services.worker.engine.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

EOS = 2


def make(num_blocks: int = 16, block_size: int = 4, *, max_num_seqs: int = 8,
         max_batched_tokens: int = 64, max_model_len: int = 256, prefix_caching: bool = False,
         max_prefill_tokens_with_decodes: int = 64) -> Scheduler:
    """Without prefix caching unless asked: these tests name the blocks a recompute takes."""
    return Scheduler(BlockAllocator(num_blocks, block_size),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                                     max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
                                     max_model_len=max_model_len, prefix_caching=prefix_caching),
                     eos_token_ids=[EOS])


def seq(seq_id: int, prompt_len: int, max_tokens: int = 8, **params) -> Sequence:
    prompt = [100 + seq_id * 10 + i for i in range(prompt_len)]
    return Sequence(seq_id, prompt, SamplingParams(max_tokens=max_tokens, **params))


def chunks(out: SchedulerOutput) -> list[tuple]:
    return [(s.seq_id, s.positions, s.slots, s.block_table, s.sample, s.context_len)
            for s in out.scheduled]


def tokens(out: SchedulerOutput) -> list[int]:
    return [t for s in out.scheduled for t in s.token_ids]


def test_admits_in_arrival_order_with_exact_slots_and_tables() -> None:
    s = make()
    for sid, n in ((0, 3), (1, 2), (2, 4)):
        s.add(seq(sid, n))
    out = s.schedule()
    assert chunks(out) == [
        (0, [0, 1, 2], [0, 1, 2], [0], True, 3),
        (1, [0, 1], [4, 5], [1], True, 2),
        (2, [0, 1, 2, 3], [8, 9, 10, 11], [2], True, 4),
    ]
    assert out.query_lens == [3, 2, 4] and out.context_lens == [3, 2, 4]
    batch = flatten(out.scheduled)  # the step's rows, as the runner lays them out
    assert batch.input_ids.tolist() == [100, 101, 102, 110, 111, 120, 121, 122, 123]
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert batch.meta.slot_mapping.tolist() == [0, 1, 2, 4, 5, 8, 9, 10, 11]
    assert batch.sample_rows == [2, 4, 8]
    assert batch.meta.block_tables.tolist() == [[0], [1], [2]]
    assert [q.arrival for q in (s.get(0), s.get(1), s.get(2))] == [0, 1, 2]
    assert s.num_running == 3 and s.num_waiting == 0


def test_decode_batching() -> None:
    s = make()
    for sid, n in ((0, 3), (1, 4), (2, 1)):
        s.add(seq(sid, n))
    s.schedule()
    assert s.on_step_done({0: 50, 1: 51, 2: 52}) == []
    out = s.schedule()
    # seq 1 filled block 1 with its prompt: its decode at position 4 starts a new block (3)
    assert chunks(out) == [
        (0, [3], [3], [0], True, 4),
        (1, [4], [12], [1, 3], True, 5),
        (2, [1], [9], [2], True, 2),
    ]
    assert tokens(out) == [50, 51, 52]
    assert out.num_batched_tokens == 3 and all(c.is_decode for c in out.scheduled)


def test_chunked_prefill_splits_exactly_and_decodes_go_first() -> None:
    s = make(max_batched_tokens=8)
    s.add(seq(0, 2))
    s.add(seq(1, 20))
    out = s.schedule()
    assert chunks(out) == [
        (0, [0, 1], [0, 1], [0], True, 2),
        (1, list(range(6)), [4, 5, 6, 7, 8, 9], [1, 2], False, 6),
    ]
    s.on_step_done({0: 7, 1: None})
    assert s.get(1).num_computed_tokens == 6 and s.get(1).output_token_ids == []
    out = s.schedule()
    assert chunks(out) == [
        (0, [2], [2], [0], True, 3),
        (1, list(range(6, 13)), [10, 11, 12, 13, 14, 15, 16], [1, 2, 3, 4], False, 13),
    ]
    assert tokens(out) == [7, *range(116, 123)]
    s.on_step_done({0: 8, 1: None})
    out = s.schedule()
    assert chunks(out) == [
        (0, [3], [3], [0], True, 4),
        (1, list(range(13, 20)), [17, 18, 19, 20, 21, 22, 23], [1, 2, 3, 4, 5], True, 20),
    ]
    assert out.num_batched_tokens == 8
    s.on_step_done({0: 9, 1: 30})
    assert s.get(1).output_token_ids == [30]
    out = s.schedule()
    assert [(c.seq_id, c.positions) for c in out.scheduled] == [(0, [4]), (1, [20])]


def test_prefill_chunks_are_capped_while_a_sequence_decodes() -> None:
    s = make(max_batched_tokens=32, max_prefill_tokens_with_decodes=8)
    s.add(seq(0, 2, max_tokens=20))
    s.schedule()
    s.on_step_done({0: 7})  # seq 0 decodes from now on
    s.add(seq(1, 30))
    s.add(seq(2, 3))
    lens = []
    for _ in range(5):
        out = s.schedule()
        lens.append([(c.seq_id, len(c.positions)) for c in out.scheduled])
        s.on_step_done({c.seq_id: 5 if c.sample else None for c in out.scheduled})
    # one decode and at most 8 prefill tokens a step; seq 2 waits behind seq 1 (first come, first served)
    assert lens == [[(0, 1), (1, 8)], [(0, 1), (1, 8)], [(0, 1), (1, 8)], [(0, 1), (1, 6), (2, 2)],
                    [(0, 1), (1, 1), (2, 1)]]
    alone = make(max_batched_tokens=32, max_prefill_tokens_with_decodes=8)
    alone.add(seq(0, 30))
    assert alone.schedule().query_lens == [30]  # nothing decoding: the whole budget


def test_long_prompt_alone_uses_the_whole_budget_each_step() -> None:
    s = make(max_batched_tokens=5)
    s.add(seq(0, 12))
    lens = []
    for _ in range(3):
        out = s.schedule()
        lens.append((out.query_lens, out.scheduled[0].sample))
        s.on_step_done({0: 1 if out.scheduled[0].sample else None})
    assert lens == [([5], False), ([5], False), ([2], True)]


def test_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    s = make(num_blocks=4, block_size=4)
    s.add(seq(0, 8, max_tokens=1))   # 2 blocks
    s.add(seq(1, 12, max_tokens=1))  # 3 blocks: does not fit behind seq 0
    s.add(seq(2, 1, max_tokens=1))   # would fit, but FCFS keeps it behind seq 1
    out = s.schedule()
    assert out.seq_ids == [0]
    assert [q.seq_id for q in s.waiting] == [1, 2]


def test_max_num_seqs_caps_running() -> None:
    s = make(max_num_seqs=2)
    for sid in range(3):
        s.add(seq(sid, 2))
    assert s.schedule().seq_ids == [0, 1]
    s.on_step_done({0: 5, 1: 5})
    assert s.schedule().seq_ids == [0, 1]
    assert s.num_waiting == 1


def test_preempts_newest_with_exact_blocks_and_recomputes_later() -> None:
    s = make(num_blocks=4, block_size=2)
    a, b = seq(0, 3, max_tokens=3), seq(1, 3, max_tokens=3)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(c.seq_id, c.block_table) for c in out.scheduled] == [(0, [0, 1]), (1, [2, 3])]
    s.on_step_done({0: 10, 1: 20})
    out = s.schedule()  # positions 3 fit the second blocks
    assert chunks(out) == [(0, [3], [3], [0, 1], True, 4), (1, [3], [7], [2, 3], True, 4)]
    s.on_step_done({0: 11, 1: 21})
    out = s.schedule()  # a needs a third block: b (newest) is preempted
    assert out.preempted == [1]
    assert chunks(out) == [(0, [4], [6], [0, 1, 3], True, 5)]  # b's blocks came back last first
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [20, 21] and b.num_preemptions == 1
    assert list(s.waiting) == [b] and 1 not in s.allocator
    assert s.allocator.num_free_blocks == 1  # block 2
    assert s.on_step_done({0: 12}) == [a]
    assert a.finish_reason is FinishReason.LENGTH and a.output_token_ids == [10, 11, 12]
    assert s.allocator.num_free_blocks == 4
    out = s.schedule()  # b recomputes prompt + outputs: 5 tokens, 3 blocks, free list [2, 3, 1, 0]
    assert chunks(out) == [(1, [0, 1, 2, 3, 4], [4, 5, 6, 7, 2], [2, 3, 1], True, 5)]
    assert tokens(out) == [110, 111, 112, 20, 21]
    assert s.on_step_done({1: 22}) == [b]
    assert b.output_token_ids == [20, 21, 22]
    assert s.allocator.num_free_blocks == 4 and not s.has_unfinished


def test_preempts_itself_when_it_is_the_newest() -> None:
    s = make(num_blocks=3, block_size=2)
    s.add(seq(0, 3, max_tokens=2))  # blocks [0, 1]; position 3 still fits block 1
    s.add(seq(1, 2, max_tokens=2))  # block [2]; position 2 needs a new block
    s.schedule()
    s.on_step_done({0: 5, 1: 6})
    out = s.schedule()
    # seq 0 is already scheduled this step, so seq 1, the newest, preempts itself
    assert out.preempted == [1]
    assert chunks(out) == [(0, [3], [3], [0, 1], True, 4)]
    # no admission in a step that preempted, though seq 1 is at the front of waiting and a
    # block is free now
    assert [q.seq_id for q in s.waiting] == [1] and s.allocator.num_free_blocks == 1
    s.on_step_done({0: 7})  # seq 0 finishes (max_tokens=2)
    out = s.schedule()
    assert chunks(out) == [(1, [0, 1, 2], [4, 5, 2], [2, 1], True, 3)]  # free list [2, 1, 0]
    assert tokens(out) == [110, 111, 6]


def test_abort_frees_blocks_for_waiting_running_and_in_flight() -> None:
    s = make(num_blocks=8, block_size=4)
    s.add(seq(0, 5))
    s.add(seq(1, 3))
    s.schedule()
    s.add(seq(2, 4))  # waiting
    assert s.allocator.num_used_blocks == 3
    aborted = s.abort(0)  # in flight
    assert aborted.status is SequenceStatus.FINISHED and aborted.finish_reason is FinishReason.CANCELLED
    assert s.allocator.num_used_blocks == 1 and s.in_flight == {1}
    assert s.abort(2).finish_reason is FinishReason.CANCELLED
    assert s.num_waiting == 0
    assert s.abort(2) is None and s.abort(99) is None
    # the late report of the aborted in-flight sequence is ignored
    assert s.on_step_done({0: 7, 1: 8}) == []
    assert s.get(1).output_token_ids == [8]
    assert s.abort(1) is not None
    assert s.allocator.num_free_blocks == 8 and not s.has_unfinished


def test_stop_conditions() -> None:
    s = make()
    s.add(seq(0, 2, max_tokens=5))
    s.add(seq(1, 2, max_tokens=5, ignore_eos=True))
    s.add(seq(2, 2, max_tokens=5, ignore_eos=True, stop_token_ids=[9]))
    s.add(seq(3, 2, max_tokens=2))
    s.schedule()
    done = s.on_step_done({0: EOS, 1: EOS, 2: 9, 3: 4})
    assert [(q.seq_id, q.finish_reason) for q in done] == [(0, FinishReason.EOS_TOKEN),
                                                           (2, FinishReason.EOS_TOKEN)]
    s.schedule()
    done = s.on_step_done({1: 4, 3: 4})
    assert [(q.seq_id, q.finish_reason) for q in done] == [(3, FinishReason.LENGTH)]
    assert s.get(1).output_token_ids == [EOS, 4]
    # a stop string found by the caller
    finished = s.finish(1, FinishReason.STOP_SEQUENCE)
    assert finished.finish_reason is FinishReason.STOP_SEQUENCE
    assert s.allocator.num_free_blocks == 16


def test_output_logprobs_are_recorded() -> None:
    s = make()
    s.add(seq(0, 2))
    s.schedule()
    s.on_step_done({0: 4}, logprobs={0: -0.25})
    assert s.get(0).output_logprobs == [-0.25]


def test_rejects_requests_beyond_max_model_len_or_kv_capacity() -> None:
    s = make(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(InvalidRequest, match=r"^prompt \(15 tokens\) \+ max_tokens \(6\) = 21 exceeds the "
                                             r"maximum context length max_model_len=20$"):
        s.add(seq(0, 15, max_tokens=6))
    s2 = make(num_blocks=4, block_size=4, max_model_len=100)
    s2.add(seq(0, 15, max_tokens=2))  # 16 tokens of KV: exactly 4 blocks
    with pytest.raises(InvalidRequest, match=r"^prompt \(15 tokens\) \+ max_tokens \(3\) needs KV cache for "
                                             r"17 tokens \(5 blocks of 4\), but the KV cache holds 4 "
                                             r"blocks \(16 tokens\)$"):
        s2.add(seq(1, 15, max_tokens=3))
    assert s2.max_tokens_supported() == 17
    with pytest.raises(InvalidRequest, match="seq_id 0 is already in use"):
        s2.add(seq(0, 2))
    assert s.num_waiting == 0 and s2.num_waiting == 1


def test_micro_batches_never_share_a_sequence() -> None:
    s = make()
    s.add(seq(0, 3))
    s.add(seq(1, 2))
    mb1 = s.schedule()
    assert mb1.seq_ids == [0, 1] and s.in_flight == {0, 1}
    assert s.schedule().is_empty  # both in flight
    s.add(seq(2, 4))
    mb2 = s.schedule()
    assert mb2.seq_ids == [2]
    s.on_step_done({0: 5, 1: 6})
    mb3 = s.schedule()
    assert mb3.seq_ids == [0, 1]
    assert s.in_flight == {0, 1, 2}
    s.on_step_done({2: 7})
    assert s.schedule().seq_ids == [2]


def test_in_flight_sequences_are_never_preempted_the_older_waits_for_them() -> None:
    s = make(num_blocks=3, block_size=2)
    s.add(seq(0, 2, max_tokens=2))
    mb1 = s.schedule()
    assert mb1.scheduled[0].block_table == [0]
    s.add(seq(1, 4, max_tokens=2))
    mb2 = s.schedule()
    assert [(c.seq_id, c.block_table) for c in mb2.scheduled] == [(1, [1, 2])]
    s.on_step_done({0: 5})
    # seq 0 needs a block; the only newer sequence is in flight: seq 0 waits, keeping its block
    mb3 = s.schedule()
    assert mb3.is_empty and mb3.preempted == []
    assert s.allocator.block_table(0) == [0]
    s.on_step_done({1: 7})
    # seq 1 is back: seq 0 (older) preempts it and takes the first freed block (seq 1's last)
    mb4 = s.schedule()
    assert mb4.preempted == [1]
    assert chunks(mb4) == [(0, [2], [4], [0, 2], True, 3)]
    assert [q.seq_id for q in s.waiting] == [1] and s.get(1).output_token_ids == [7]


def test_preempted_sequences_rejoin_waiting_in_arrival_order() -> None:
    s = make(num_blocks=7, block_size=1)
    for sid in range(3):
        s.add(seq(sid, 2, max_tokens=5))
    s.schedule()  # 0 -> [0, 1], 1 -> [2, 3], 2 -> [4, 5]; block 6 free
    s.add(seq(3, 1, max_tokens=1))
    s.on_step_done({0: 5, 1: 5, 2: 5})
    out = s.schedule()
    assert out.preempted == [2]  # for seq 1; seq 0 took the free block
    assert chunks(out) == [(0, [2], [6], [0, 1, 6], True, 3), (1, [2], [5], [2, 3, 5], True, 3)]
    assert [q.seq_id for q in s.waiting] == [2, 3]
    s.on_step_done({0: 5, 1: 5})
    out = s.schedule()
    assert out.preempted == [1]  # nothing newer runs: seq 1 preempts itself
    assert chunks(out) == [(0, [3], [4], [0, 1, 6, 4], True, 4)]  # free list [4, 5, 3, 2]
    # seq 1 was preempted after seq 2 but arrived before it
    assert [q.seq_id for q in s.waiting] == [1, 2, 3]
    assert s.allocator.num_free_blocks == 3


def test_protocol_errors() -> None:
    s = make(max_batched_tokens=4)
    with pytest.raises(SchedulerError, match="sequence 0 is not in flight"):
        s.on_step_done({0: 1})
    s.add(seq(0, 6))
    s.schedule()
    with pytest.raises(SchedulerError, match=r"sequence 0: expected None \(prefill chunk without sampling\), got 3"):
        s.on_step_done({0: 3})
    s.on_step_done({0: None})  # still in flight after the bad report
    s.schedule()
    with pytest.raises(SchedulerError, match="sequence 0: expected a sampled token, got None"):
        s.on_step_done({0: None})


def test_budget_and_seq_count_validation() -> None:
    with pytest.raises(ValueError, match="max_batched_tokens must be an integer >= 1, got 0"):
        SchedulerConfig(max_batched_tokens=0)


# ---- simulation: a fake deterministic model, outputs independent of batching ---------------

VOCAB = 50


def fake_next_token(tokens: list[int]) -> int:
    """A 'model' whose next token depends on the whole context (so a wrong recompute shows)."""
    h = 0
    for t in tokens:
        h = (h * 31 + t + 7) % 1_000_003
    return 3 + h % (VOCAB - 3)  # never EOS


def alone(seqs: list[Sequence]) -> dict[int, list[int]]:
    """Each sequence's outputs as if it ran by itself (``fake_next_token`` of its own tokens)."""
    expected = {}
    for q in seqs:
        tokens = list(q.prompt_token_ids)
        for _ in range(q.sampling_params.max_tokens):
            tokens.append(fake_next_token(tokens))
        expected[q.seq_id] = tokens[q.num_prompt_tokens:]
    return expected


def run_to_completion(s: Scheduler, seqs: list[Sequence], *, pp: int = 1,
                      max_steps: int = 10_000) -> dict[int, list[int]]:
    """Drive the scheduler with up to ``pp`` micro-batches in flight; check invariants each step.
    A simulated KV cache holds, in each slot a step writes, the tokens up to that position (what
    a real key and value depend on); every step's context must read back its own tokens, so a
    prefix hit on wrong blocks, or a block written while another sequence reads it, fails."""
    for q in seqs:
        s.add(q)
    kv: dict[int, int] = {}
    size = s.allocator.block_size
    results: dict[int, list[int]] = {}
    in_flight: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not s.has_unfinished and not in_flight:
            return results
        while len(in_flight) < pp:
            out = s.schedule()
            if out.is_empty:
                break
            assert out.num_batched_tokens <= s.config.max_batched_tokens
            ids = [c.seq_id for mb in in_flight for c in mb.scheduled]
            assert not set(ids) & set(out.seq_ids)
            in_flight.append(out)
        s.allocator.check_invariants()
        assert s.num_running <= s.config.max_num_seqs
        assert in_flight, "scheduler stalled with unfinished sequences"
        out = in_flight.pop(0)
        sampled: dict[int, int | None] = {}
        for c in out.scheduled:
            q = s.get(c.seq_id)
            if q is None:
                continue
            # the chunk must be exactly the next uncomputed tokens of the sequence
            assert c.token_ids == q.all_token_ids[c.positions[0]:c.context_len]
            assert c.slots == [c.block_table[p // size] * size + p % size for p in c.positions]
            tokens = q.all_token_ids
            for p, slot in zip(c.positions, c.slots, strict=True):
                kv[slot] = hash(tuple(tokens[:p + 1]))
            for p in range(c.context_len):
                assert kv.get(c.block_table[p // size] * size + p % size) == hash(tuple(tokens[:p + 1])), \
                    f"sequence {c.seq_id} reads another's keys and values at position {p}"
            sampled[c.seq_id] = fake_next_token(q.all_token_ids[:c.context_len]) if c.sample else None
        for q in s.on_step_done(sampled):
            results[q.seq_id] = list(q.output_token_ids)
    raise AssertionError("did not finish")


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=8),
    num_blocks=st.integers(10, 40),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    pp=st.integers(1, 3),
)
def test_outputs_match_running_alone_under_pressure(lens: list[tuple[int, int]], num_blocks: int,
                                                    block_size: int, budget: int, max_num_seqs: int,
                                                    pp: int) -> None:
    capacity = num_blocks * block_size
    lens = [(p, m) for p, m in lens if p + m - 1 <= capacity]
    seqs = [seq(i, p, max_tokens=m) for i, (p, m) in enumerate(lens)]
    expected = alone(seqs)
    s = make(num_blocks, block_size, max_num_seqs=max_num_seqs, max_batched_tokens=budget, max_model_len=1000)
    assert run_to_completion(s, seqs, pp=pp) == expected
    assert s.allocator.num_free_blocks == num_blocks
    assert not s.has_unfinished and not s.in_flight


def test_tight_kv_budget_preempts_and_still_matches() -> None:
    seqs = [seq(i, 10 + i, max_tokens=12) for i in range(6)]
    expected = alone(seqs)
    s = make(num_blocks=12, block_size=4, max_batched_tokens=16)
    assert run_to_completion(s, seqs) == expected
    assert sum(q.num_preemptions for q in seqs) > 0
