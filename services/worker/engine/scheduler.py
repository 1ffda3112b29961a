"""Continuous batching with chunked prefill and preemption by recompute.

Pure Python: no torch, no torch.distributed, no gRPC. The driver calls ``schedule()`` to get
one step's (micro-batch's) work, runs it across the replica group, and reports the sampled
tokens with ``on_step_done``.

Priority is arrival order: both queues are kept sorted by ``Sequence.arrival`` (the oldest
first), and an older sequence is never preempted for a newer one. Each ``schedule()``:

1. **Decodes.** Every running sequence with exactly one uncomputed token (its last sampled
   token) gets one slot, oldest first. If it needs a new block and none is free, the *newest*
   running sequence that is newer than it (and not in flight, not already in this step) is
   preempted: its blocks are freed and it goes back to the waiting queue, ahead of every
   later arrival, with its generated tokens kept, to be prefilled again (prompt + outputs so
   far, "recompute") when it is re-admitted. If no newer sequence can be preempted now
   because the newer ones are in flight or already in this step, the sequence waits for a
   later step, keeping its blocks; if there is no newer running sequence at all, the
   sequence itself is the newest and is the one preempted.
2. **Unfinished prefills.** Running sequences admitted with only part of their prompt get
   their next chunk, within the remaining token budget (same preemption rule).
3. **Admission.** Unless something was preempted or had to wait for blocks this step, waiting
   sequences are admitted in order (first come, first served: a sequence that does not fit
   blocks those behind it) while the token budget, free blocks and ``max_num_seqs`` allow. A
   prompt longer than the remaining budget is admitted with a first chunk and continues in
   later steps (chunked prefill), so long prompts never stall running decodes. While any
   running sequence decodes, the prefill chunks of 2 and 3 together take at most
   ``max_prefill_tokens_with_decodes`` tokens of the step, so that its time (which every decode
   waits for) stays short; with nothing decoding they take the whole budget.

**Prefix caching** (``SchedulerConfig.prefix_caching``, on by default). Every full block of a
sequence's tokens has a hash (``services.common.prefix_blocks``: its parent's hash and its tokens,
and the request's cache salt); once a step is planned that writes a block's last token, the block is
registered under it (``BlockAllocator.cache_blocks``). Admission looks up the sequence's longest
run of cached blocks from the first, takes them into its table, shared, and counts their tokens
as computed, so only the rest is prefilled; a preempted sequence finds its own blocks again unless
they were evicted meanwhile. The last token is always run (its logits are what is sampled), so a
hit stops at the last full block before it. Keys and values do not depend on the batch or the
chunking they were computed in (the kernels are batch-invariant), so a hit changes no output.

Liveness: the oldest running sequence is never preempted (only newer ones are victims, and it
preempts itself only when no other sequence runs, when its blocks always fit since
``check_request`` bounds every request by the whole cache). It waits only while newer
sequences are in flight or decoding, and those finish or give way, so every request completes.

Invariants:

- the tokens of one step never exceed ``max_batched_tokens``; running sequences never exceed
  ``max_num_seqs``;
- a scheduled sequence is *in flight* until ``on_step_done`` reports it; an in-flight sequence
  is neither scheduled again nor preempted, so with pipeline parallelism several micro-batches
  can be in flight and no two of them contain the same sequence;
- every running sequence holds exactly the blocks for its scheduled tokens; waiting and
  finished sequences hold none.

Abort/finish frees blocks at once, even for an in-flight sequence: each pipeline stage runs
micro-batches in order, so a block handed to a later micro-batch is written at each stage only
after the earlier micro-batch is done with it there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.common.prefix_blocks import block_hash, reusable_blocks
from services.common.sampling import FinishReason, InvalidRequest
from services.worker.engine.block_manager import BlockAllocator
from services.worker.engine.sequence import Sequence, SequenceStatus


class SchedulerError(RuntimeError):
    """The caller broke the scheduler's protocol (e.g. reported a sequence not in flight)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. ``max_batched_tokens`` is the per-step token budget shared by decodes
    and prefill chunks; ``max_prefill_tokens_with_decodes`` caps a step's prefill chunks while
    any running sequence is decoding (a step's time grows with its tokens and every decode waits
    for it, so this bounds the gap between their tokens; with nothing decoding, prefills take the
    whole budget); ``max_model_len`` caps prompt + max_tokens; ``prefix_caching``: reuse the
    cached blocks of a prefix (see the module docstring)."""

    max_num_seqs: int = 256
    max_batched_tokens: int = 2048
    max_prefill_tokens_with_decodes: int = 256
    max_model_len: int = 2048
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batched_tokens", "max_prefill_tokens_with_decodes", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: run ``token_ids`` at ``positions`` writing KV to
    ``slots``; attend over ``context_len`` tokens through ``block_table``. When ``sample`` the
    chunk completes the prefill (or is a decode) and the logits of its last token are sampled.
    (The step's rows are laid out once, by :func:`services.worker.engine.batch.flatten`.)"""

    seq_id: int
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_table: list[int]
    sample: bool
    context_len: int

    @property
    def query_len(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.context_len > 1


@dataclass
class SchedulerOutput:
    """One step (one micro-batch). Decodes come first, then prefill chunks."""

    step_id: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def seq_ids(self) -> list[int]:
        return [s.seq_id for s in self.scheduled]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.query_len for s in self.scheduled)

    @property
    def query_lens(self) -> list[int]:
        return [s.query_len for s in self.scheduled]

    @property
    def context_lens(self) -> list[int]:
        return [s.context_len for s in self.scheduled]


class Scheduler:
    """Waiting and running queues over one ``BlockAllocator``; see the module docstring."""

    def __init__(self, allocator: BlockAllocator, config: SchedulerConfig | None = None, *,
                 eos_token_ids: Iterable[int] = ()) -> None:
        self.allocator = allocator
        self.config = config or SchedulerConfig()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self._seqs: dict[int, Sequence] = {}  # waiting + running
        self._in_flight: dict[int, ScheduledSequence] = {}
        self._dropped_in_flight: set[int] = set()  # finished while in flight; ignore their report
        self._next_arrival = 0
        self._next_step = 0
        # prompt tokens looked up in the prefix cache at admission, and those found there
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0  # since the engine started

    # ---- queries ----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def in_flight(self) -> frozenset[int]:
        return frozenset(self._in_flight)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id: int) -> Sequence | None:
        """The waiting or running sequence with this id (None once finished)."""
        return self._seqs.get(seq_id)

    def max_tokens_supported(self) -> int:
        """The longest prompt + max_tokens a request may have here."""
        kv_tokens = self.allocator.capacity_tokens + 1  # the last sampled token is never cached
        return min(self.config.max_model_len, kv_tokens)

    # ---- requests ---------------------------------------------------------------------

    def check_request(self, seq: Sequence) -> None:
        """Raise ``InvalidRequest`` if the request can never run here (numbers in the message).

        The KV need is prompt + max_tokens - 1 tokens: the last sampled token's KV is never
        written, because the sequence finishes as soon as it is sampled.
        """
        p, m = seq.num_prompt_tokens, seq.sampling_params.max_tokens
        if p + m > self.config.max_model_len:
            raise InvalidRequest(
                f"prompt ({p} tokens) + max_tokens ({m}) = {p + m} exceeds the maximum context "
                f"length max_model_len={self.config.max_model_len}")
        kv_tokens = p + m - 1
        blocks = self.allocator.blocks_needed(kv_tokens)
        if blocks > self.allocator.num_blocks:
            raise InvalidRequest(
                f"prompt ({p} tokens) + max_tokens ({m}) needs KV cache for {kv_tokens} tokens "
                f"({blocks} blocks of {self.allocator.block_size}), but the KV cache holds "
                f"{self.allocator.num_blocks} blocks ({self.allocator.capacity_tokens} tokens)")

    def add(self, seq: Sequence) -> None:
        """Queue a new request at the back of the waiting queue (after ``check_request``)."""
        if seq.seq_id in self._seqs or seq.seq_id in self._dropped_in_flight:
            raise InvalidRequest(f"seq_id {seq.seq_id} is already in use")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
            raise InvalidRequest(f"sequence {seq.seq_id} must be new (WAITING, nothing computed), "
                                 f"got {seq.status.name} with {seq.num_computed_tokens} computed")
        self.check_request(seq)
        params = seq.sampling_params  # what ends it: its stop ids and, unless ignored, EOS
        seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def finish(self, seq_id: int, reason: FinishReason) -> Sequence | None:
        """End a waiting or running sequence now (stop string, cancel), freeing its blocks.
        Returns it, or None if it is unknown or already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        self._finish(seq, reason)
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        """Cancel a request wherever it is; its blocks are free when this returns."""
        return self.finish(seq_id, FinishReason.CANCELLED)

    # ---- stepping ---------------------------------------------------------------------

    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """Plan one step (micro-batch) from the sequences not already in flight, with at most
        ``max_seqs`` sequences (pipeline parallelism splits the batch into micro-batches)."""
        out = SchedulerOutput(step_id=self._next_step)
        cap = self.config.max_num_seqs if max_seqs is None else max(1, max_seqs)
        self._next_step += 1
        budget = self.config.max_batched_tokens
        decoding = any(s.status is SequenceStatus.RUNNING and s.num_uncomputed_tokens == 1 for s in self.running)
        prefill_left = min(budget, self.config.max_prefill_tokens_with_decodes) if decoding else budget
        scheduled_ids: set[int] = set()
        blocked = False  # a running sequence preempted or waited for blocks: admit nobody

        for decodes in (True, False):
            for seq in list(self.running):
                if budget == 0 or len(out.scheduled) >= cap or (not decodes and prefill_left == 0):
                    break
                if (seq.status is not SequenceStatus.RUNNING or seq.seq_id in self._in_flight
                        or seq.seq_id in scheduled_ids):
                    continue  # preempted as a victim earlier in this loop, or busy
                remaining = seq.num_uncomputed_tokens
                if (remaining == 1) != decodes:
                    continue
                n = min(remaining, budget if decodes else min(budget, prefill_left))
                if not self._make_room(seq, seq.num_computed_tokens + n, scheduled_ids, out):
                    blocked = True
                    continue
                self._emit(seq, n, out, scheduled_ids)
                budget -= n
                if not decodes:
                    prefill_left -= n

        if not blocked and not out.preempted:
            while (self.waiting and min(budget, prefill_left) > 0 and len(self.running) < self.config.max_num_seqs
                   and len(out.scheduled) < cap):
                seq = self.waiting[0]
                hit = self._prefix_hit(seq)  # waiting sequences have nothing else computed
                computed = len(hit) * self.allocator.block_size
                n = min(seq.num_tokens - computed, budget, prefill_left)
                if not self.allocator.can_allocate(computed + n, hit):
                    break
                self.allocator.allocate(seq.seq_id, computed + n, hit)
                seq.num_computed_tokens = computed
                if self.config.prefix_caching:
                    self.prefix_cache_queries += seq.num_tokens
                    self.prefix_cache_hits += computed
                self.waiting.popleft()
                _insert_by_arrival(self.running, seq)
                seq.status = SequenceStatus.RUNNING
                self._emit(seq, n, out, scheduled_ids)
                budget -= n
                prefill_left -= n
        return out

    def on_step_done(self, sampled: Mapping[int, int | None],
                     logprobs: Mapping[int, float] | None = None) -> list[Sequence]:
        """Report a finished step: ``sampled`` maps every seq_id of that step's output to its
        sampled token (None for a prefill chunk that did not sample); ``logprobs`` optionally
        gives each sampled token's logprob. Appends the tokens, applies max_tokens, EOS (unless
        ignore_eos), stop_token_ids and max_model_len, frees finished sequences' blocks, and
        returns the sequences that finished."""
        finished: list[Sequence] = []
        for seq_id, token in sampled.items():
            chunk = self._in_flight.pop(seq_id, None)
            if chunk is None:
                if seq_id in self._dropped_in_flight:
                    self._dropped_in_flight.discard(seq_id)
                    continue
                raise SchedulerError(f"sequence {seq_id} is not in flight; in flight: {sorted(self._in_flight)}")
            if chunk.sample != (token is not None):
                self._in_flight[seq_id] = chunk
                want = "a sampled token" if chunk.sample else "None (prefill chunk without sampling)"
                raise SchedulerError(f"sequence {seq_id}: expected {want}, got {token!r}")
            seq = self._seqs[seq_id]
            seq.num_computed_tokens = chunk.context_len
            if token is None:
                continue
            seq.output_token_ids.append(token)
            if logprobs is not None and seq_id in logprobs:
                seq.output_logprobs.append(logprobs[seq_id])
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    # ---- internals --------------------------------------------------------------------

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.sampling_params
        if token in seq.stop_ids:
            return FinishReason.EOS_TOKEN
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _block_hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of ``seq``'s full blocks (computed once, as blocks fill)."""
        size, hashes = self.allocator.block_size, seq.block_hashes
        for index in range(len(hashes), seq.num_tokens // size):
            hashes.append(block_hash(hashes[-1] if hashes else None,
                                     seq.token_ids_slice(index * size, (index + 1) * size),
                                     seq.sampling_params.cache_salt))
        return hashes

    def _prefix_hit(self, seq: Sequence) -> list[int]:
        """The cached blocks that start ``seq``, short of its last token (which is always run)."""
        if not self.config.prefix_caching:
            return []
        usable = reusable_blocks(seq.num_tokens, self.allocator.block_size)
        return self.allocator.cached_prefix(self._block_hashes(seq)[:usable])

    def _make_room(self, seq: Sequence, total_tokens: int, scheduled_ids: set[int],
                   out: SchedulerOutput) -> bool:
        """Grow ``seq``'s blocks to ``total_tokens``, preempting newer running sequences (the
        newest first) while blocks are short. False if ``seq`` cannot run this step: it was
        preempted itself, or it waits (keeping its blocks) for busy newer sequences."""
        while not self.allocator.can_grow(seq.seq_id, total_tokens):
            newer = [s for s in self.running if s.arrival > seq.arrival]
            victims = [s for s in newer if s.seq_id not in self._in_flight and s.seq_id not in scheduled_ids]
            if victims:
                self._preempt(victims[-1], out)
            elif newer:
                return False  # newer sequences hold blocks but are busy: wait for them
            else:
                self._preempt(seq, out)
                return False
        self.allocator.ensure_capacity(seq.seq_id, total_tokens)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.allocator.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        _insert_by_arrival(self.waiting, seq)
        out.preempted.append(seq.seq_id)

    def _emit(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled_ids: set[int]) -> None:
        start = seq.num_computed_tokens
        stop = start + n
        chunk = ScheduledSequence(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids_slice(start, stop),
            positions=list(range(start, stop)),
            slots=self.allocator.slots(seq.seq_id, start, stop),
            block_table=self.allocator.block_table(seq.seq_id),
            sample=stop == seq.num_tokens,
            context_len=stop,
        )
        out.scheduled.append(chunk)
        scheduled_ids.add(seq.seq_id)
        self._in_flight[seq.seq_id] = chunk
        if self.config.prefix_caching and stop // self.allocator.block_size > seq.num_computed_tokens // \
                self.allocator.block_size:  # the chunk fills a block
            self.allocator.cache_blocks(seq.seq_id, self._block_hashes(seq)[:stop // self.allocator.block_size])

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.seq_id in self.allocator:
            self.allocator.free(seq.seq_id)
        if self._in_flight.pop(seq.seq_id, None) is not None:
            self._dropped_in_flight.add(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]


def _insert_by_arrival(queue: deque[Sequence], seq: Sequence) -> None:
    """Insert keeping ``queue`` sorted by arrival (a new arrival simply goes to the back)."""
    if not queue or queue[-1].arrival < seq.arrival:
        queue.append(seq)
        return
    index = next(i for i, other in enumerate(queue) if other.arrival > seq.arrival)
    queue.insert(index, seq)
