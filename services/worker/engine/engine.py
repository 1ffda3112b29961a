"""LLMEngine: the driver's loop — scheduler, steps across the group, streaming outputs.

Runs on global rank 0. Each iteration it applies queued submissions and cancellations, asks the
scheduler for a micro-batch, broadcasts the :class:`StepPlan` over the control group, runs its own
shard of it, and hands sampled tokens back to the scheduler and to each request's stream. With
PP > 1 up to PP micro-batches are in flight at once (the scheduler never puts a sequence in two),
so stage 0 starts the next micro-batch while later stages still work on the previous ones; the
last stage's samples come back over the result group in order. When there is nothing to do the
driver broadcasts a heartbeat plan, so a dead rank is noticed within seconds even when idle.

Threads: ``submit``/``abort`` may be called from any thread (gRPC handlers); everything else runs
on the loop thread. A request's events go to its handle's ``events`` sink (a queue of its own,
or one the caller passes, e.g. a Relay stream's batcher); after each step's events (and after a
failure's error events) the loop calls every ``output_listeners`` entry, so a consumer can send
one step's events of many requests together. ``step_listeners`` (:class:`StepListener`) observe
submissions, each step's plan and result, and the end of each request: tracing is one.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers import Tokenizer

from services.common.detokenizer import Detokenizer, TokenTexts
from services.common.errors import Unavailable
from services.common.sampling import MAX_LOGPROBS, FinishReason, InvalidRequest, SamplingParams
from services.modeling.parallel.coordinator import ShardGroupUnhealthy
from services.worker.engine.block_manager import BlockAllocator
from services.worker.engine.guided import Guides
from services.worker.engine.kv_budget import KVBudget
from services.worker.engine.kv_cache import KVCacheLayout
from services.worker.engine.prefix_events import PrefixCacheLog
from services.worker.engine.runner import IDLE_HEARTBEAT_S, StageRunner
from services.worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.worker.engine.sequence import Sequence
from services.worker.engine.step import SeqStep, StepPlan, StepResult, TokenEvent
from services.worker.scoring import score_tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    text: str
    first_token_ns: int
    total_ns: int


@dataclass(frozen=True)
class ErrorEvent:
    error: Exception
    token_ids: list[int]


class EventSink(Protocol):
    """Where a request's events go; ``put`` is called on the engine's loop thread."""

    def put(self, event: Any, /) -> None: ...


class StepListener(Protocol):
    """Observes the engine without changing it. ``on_submit`` runs on the submitting thread
    (after the request is queued), the others on the engine's loop thread."""

    def on_submit(self, handle: RequestHandle) -> None: ...

    def on_step_scheduled(self, plan: StepPlan) -> None: ...

    def on_step_done(self, plan: StepPlan, result: StepResult) -> None: ...

    def on_request_done(self, seq_id: int) -> None: ...


class RequestHandle:
    """A submitted request: its events arrive on ``events`` (TokenEvent…, then Finish or Error)."""

    def __init__(self, engine: LLMEngine, seq: Sequence, request_id: str, detok: Detokenizer | None, *,
                 events: EventSink | None = None) -> None:
        self.engine = engine
        self.seq = seq
        self.request_id = request_id
        self.events: EventSink = events if events is not None else queue.SimpleQueue()
        self.detok = detok
        self.submitted_ns = time.monotonic_ns()
        self.first_token_ns = 0

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    def cancel(self, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """End the request now and free its blocks; no further event comes. ``reason``:
        STOP_SEQUENCE when the client matched one of its stop strings itself (a router does)."""
        self.engine.abort(self.seq_id, reason)

    def __iter__(self):
        while True:
            event = self.events.get()
            yield event
            if not isinstance(event, TokenEvent):
                return


class LLMEngine:
    def __init__(self, runner: StageRunner, layout: KVCacheLayout, *, tokenizer: Tokenizer | None,
                 scheduler_config: SchedulerConfig) -> None:
        self.runner = runner
        self.layout = layout
        self.tokenizer = tokenizer
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        cfg = runner.rt.plan.config
        self.scheduler = Scheduler(BlockAllocator(layout.num_blocks, layout.block_size), scheduler_config,
                                   eos_token_ids=cfg.eos_token_ids)
        self.guides = Guides(tokenizer, cfg.vocab_size, cfg.eos_token_ids)  # structured outputs' matchers
        # what the prefix cache holds, for routers that route by prefix (None: no prefix caching)
        self.prefix_events = PrefixCacheLog() if scheduler_config.prefix_caching else None
        self.kv_budget = KVBudget(layout.capacity_bytes, layout.bytes_per_token)  # admission across routers
        self.scheduler.allocator.events = self.prefix_events
        self.coordinator = runner.rt.coordinator
        self.groups = runner.rt.groups
        self.max_in_flight = self.groups.pp_degree
        self._in_flight: collections.deque[StepPlan] = collections.deque()
        self.peak_in_flight = 0  # most micro-batches in flight at once (PP overlap, for tests/bench)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._requests: dict[int, RequestHandle] = {}
        self._seq_ids = itertools.count(1)
        self._lock = threading.Lock()
        self.failure: Exception | None = None
        self.draining = False
        self.stopped = False
        self._token_times: collections.deque[float] = collections.deque(maxlen=4096)
        self.step_times_s: collections.deque[float] = collections.deque(maxlen=4096)
        # called on the loop thread once a step's events are out; any thread may append/remove
        # (atomic list operations: the loop calls a snapshot)
        self.output_listeners: list[Callable[[], None]] = []
        self.step_listeners: list[StepListener] = []

    # -- any thread -----------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str = "",
               events: EventSink | None = None, reserve_kv: bool = False, texts: bool = True) -> RequestHandle:
        """Validate and queue a request. Raises InvalidRequest (bad field, too long),
        Unavailable (group failed, draining) or, with ``reserve_kv``, KVBudgetFull (its KV claim
        does not fit beside the admitted ones: ``kv_budget.py``) at once; nothing is queued then.
        ``events``: where its events go (default: a queue of the handle's own). ``texts=False``:
        the events carry no text (the caller makes its own), so the request is detokenized only
        to match its stop strings, if it has any."""
        if self.failure is not None:
            raise Unavailable(f"replica group {self.coordinator.replica_group_id} is unhealthy: {self.failure}")
        if self.draining or self.stopped:
            raise Unavailable(f"replica group {self.coordinator.replica_group_id} is draining")
        vocab = self.runner.rt.plan.config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise InvalidRequest(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        seq = Sequence(next(self._seq_ids), list(prompt_token_ids), params)
        self.scheduler.check_request(seq)
        if params.guide is not None:  # a continuation's generated ids end its prompt: the grammar has seen them
            generated = seq.prompt_token_ids[len(seq.prompt_token_ids) - params.first_step:]
            seq.matcher = self.guides.matcher(params.guide, generated)
        detok = (Detokenizer(self.tokenizer, params.stop, texts=self._token_texts)
                 if self.tokenizer is not None and (texts or params.stop) else None)
        handle = RequestHandle(self, seq, request_id or f"req-{seq.seq_id}", detok, events=events)
        self.kv_budget.admit(seq.seq_id, seq.num_prompt_tokens + params.max_tokens, reserve=reserve_kv)
        with self._lock:
            self._requests[seq.seq_id] = handle
        for listener in tuple(self.step_listeners):
            listener.on_submit(handle)
        self._commands.put(("add", seq))
        self._wakeup.set()
        return handle

    def score(self, token_ids: list[int], timeout_s: float = 600.0, *, top_logprobs: int = 0):
        """Prompt logprobs through the group (the quality gate's input), with ``top_logprobs``
        alternatives per position; any thread."""
        if self.failure is not None:
            raise Unavailable(f"replica group {self.coordinator.replica_group_id} is unhealthy: {self.failure}")
        vocab = self.runner.rt.plan.config.vocab_size
        limit = self.runner.rt.plan.config.max_position_embeddings
        if len(token_ids) > limit:
            raise InvalidRequest(f"input has {len(token_ids)} tokens, more than max_position_embeddings={limit}")
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequest(f"token ids must be in [0, {vocab})")
        done: queue.SimpleQueue = queue.SimpleQueue()
        if not 0 <= top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_logprobs}")
        self._commands.put(("score", (list(token_ids), top_logprobs, done)))
        self._wakeup.set()
        try:
            outcome = done.get(timeout=timeout_s)
        except queue.Empty:
            raise Unavailable(f"scoring did not finish within {timeout_s:g} s") from None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._commands.put(("abort", (seq_id, reason)))
        self._wakeup.set()

    def stats(self) -> dict:
        alloc = self.scheduler.allocator
        used = alloc.num_used_blocks
        now = time.monotonic()
        recent = [t for t in list(self._token_times) if now - t <= 5.0]
        return {
            "kv_bytes_used": self.layout.bytes_for_blocks(used),
            "kv_bytes_capacity": self.layout.capacity_bytes,
            "kv_bytes_per_token": self.layout.bytes_per_token,
            "blocks_total": alloc.num_blocks,
            "blocks_free": alloc.num_free_blocks,
            "blocks_used": used,
            "block_size": alloc.block_size,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "tokens_per_s": len(recent) / 5.0,
            "max_model_len": self.scheduler.max_tokens_supported(),
            "draining": self.draining,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "blocks_cached": alloc.num_cached_blocks,
            "prefix_cache_evictions": alloc.num_evictions,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_bytes_admitted": self.kv_budget.admitted,
            "kv_bytes_admitted_peak": self.kv_budget.peak,
            "kv_budget_refusals": self.kv_budget.refused,
        }

    @property
    def in_flight_requests(self) -> int:
        with self._lock:
            return len(self._requests)

    # -- loop thread ----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (then tell the other ranks to stop) or the group fails."""
        try:
            while not stop.is_set():
                if not self.step():
                    self._wakeup.wait(IDLE_HEARTBEAT_S)
                    self._wakeup.clear()
                    if self._commands.empty() and not stop.is_set():
                        self.coordinator.broadcast_object(StepPlan(-1, "idle"))
            self.shutdown()
        except ShardGroupUnhealthy as exc:
            self.fail(exc)

    def run_until_done(self) -> None:
        """Step until every submitted request has finished (CLI, tests, benchmarks)."""
        try:
            while True:
                progressed = self.step()
                with self._lock:
                    pending = bool(self._requests)
                if not pending and not self._in_flight:
                    return
                if not progressed:
                    self._wakeup.wait(0.01)
                    self._wakeup.clear()
        except ShardGroupUnhealthy as exc:
            self.fail(exc)
            raise

    def shutdown(self) -> None:
        """Collect the micro-batches still in flight (their senders wait for us), then tell every
        rank to stop."""
        if not self.stopped and self.failure is None:
            self.stopped = True
            while self._in_flight:
                result = self.coordinator.recv_object(src=self.groups.last_stage_leader)
                self._apply_result(self._in_flight.popleft(), result)
            self.coordinator.broadcast_object(StepPlan(-1, "stop"))

    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        self._apply_commands()
        if len(self._in_flight) < self.max_in_flight:
            out = self.scheduler.schedule(self._micro_batch_seqs())
            if not out.is_empty:
                plan = self._plan_of(out)
                t0 = time.perf_counter()
                self.coordinator.broadcast_object(plan)
                result = self.runner.execute(plan)
                if self.groups.last_stage_leader == 0:
                    self.step_times_s.append(time.perf_counter() - t0)
                    self._apply_result(plan, result)
                else:
                    self._in_flight.append(plan)
                    self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))
                return True
        if self._in_flight:
            result: StepResult = self.coordinator.recv_object(src=self.groups.last_stage_leader)
            plan = self._in_flight.popleft()
            assert result.step_id == plan.step_id, (result.step_id, plan.step_id)
            self._apply_result(plan, result)
            return True
        return False

    def _micro_batch_seqs(self) -> int | None:
        """With PP stages, split the live sequences into PP micro-batches so that every stage has
        work at once (bubble (p-1)/(m+p-1) shrinks as m grows); None (no cap) without PP."""
        if self.max_in_flight == 1:
            return None
        live = self.scheduler.num_running + self.scheduler.num_waiting
        return max(1, -(-live // self.max_in_flight))

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._lock:
                    alive = arg.seq_id in self._requests
                if alive:
                    self.scheduler.add(arg)
            elif kind == "abort":
                seq_id, reason = arg
                self.scheduler.finish(seq_id, reason)
                self._remove(seq_id)
            elif kind == "score":
                self._score(*arg)

    def _score(self, token_ids: list[int], top_logprobs: int, done: queue.SimpleQueue) -> None:
        while self._in_flight:  # results come back in order: finish the micro-batches first
            result = self.coordinator.recv_object(src=self.groups.last_stage_leader)
            self._apply_result(self._in_flight.popleft(), result)
        try:
            self.coordinator.broadcast_object(StepPlan(-1, "score", [SeqStep(0, token_ids, [], [], [], 0, False,
                                                                             top_logprobs=top_logprobs)]))
            done.put(score_tokens(self.runner.rt, token_ids, top_logprobs))
        except ShardGroupUnhealthy as exc:
            done.put(Unavailable(str(exc)))
            raise

    def _plan_of(self, out: SchedulerOutput) -> StepPlan:
        steps = []
        scheduled = [(s, self.scheduler.get(s.seq_id)) for s in out.scheduled]
        guided = [seq for s, seq in scheduled if s.sample and seq.matcher is not None]
        masks = self.guides.masks([seq.matcher for seq in guided]) if guided else []
        allowed_of = {seq.seq_id: mask for seq, mask in zip(guided, masks, strict=True)}
        for s, seq in scheduled:
            p = seq.sampling_params
            banned = tuple(sorted(seq.stop_ids)) if s.sample and seq.sampling_step < p.min_tokens else ()
            generated = prompt = ()
            if s.sample and p.has_penalties:  # a continuation's generated ids end its prompt
                cut = len(seq.prompt_token_ids) - p.first_step
                generated = (*seq.prompt_token_ids[cut:], *seq.output_token_ids)
                prompt = tuple(seq.prompt_token_ids[:cut]) if p.repetition_penalty != 1 else ()
            allowed = allowed_of.get(s.seq_id, b"")
            steps.append(SeqStep.of(p, seq.num_output_tokens, banned=banned, generated=generated, prompt=prompt,
                                    allowed=allowed,
                                    seq_id=s.seq_id, token_ids=s.token_ids, positions=s.positions,
                                    slots=s.slots, block_table=s.block_table, context_len=s.context_len,
                                    sample=s.sample))
        plan = StepPlan(out.step_id, "run", steps)
        for listener in tuple(self.step_listeners):
            listener.on_step_scheduled(plan)
        return plan

    def _remove(self, seq_id: int) -> None:
        with self._lock:
            removed = self._requests.pop(seq_id, None)
        self.kv_budget.release(seq_id)
        if removed is not None:
            for listener in tuple(self.step_listeners):
                listener.on_request_done(seq_id)

    def _apply_result(self, plan: StepPlan, result: StepResult) -> None:
        sampled = {s.seq_id: None for s in plan.seqs}
        logprobs = {}
        by_seq = {}
        for tok in result.sampled:
            sampled[tok.seq_id] = tok.token_id
            logprobs[tok.seq_id] = tok.logprob
            by_seq[tok.seq_id] = tok
        guided = [(i, seq) for i in by_seq if (seq := self.scheduler.get(i)) is not None and seq.matcher is not None]
        finished = {seq.seq_id: seq for seq in self.scheduler.on_step_done(sampled, logprobs)}
        for seq_id, seq in guided:  # the grammar takes the token; once complete, the sequence ends
            seq.matcher.consume_token(by_seq[seq_id].token_id)
            if seq.matcher.is_stopped() and seq_id not in finished:
                ended = self.scheduler.finish(seq_id, FinishReason.EOS_TOKEN)
                if ended is not None:
                    finished[seq_id] = ended
        now_ns = time.monotonic_ns()
        for seq_id, tok in by_seq.items():
            with self._lock:
                handle = self._requests.get(seq_id)
            if handle is None:
                continue  # cancelled while in flight
            self._token_times.append(time.monotonic())
            if not handle.first_token_ns:
                handle.first_token_ns = now_ns
            if handle.detok is not None:
                tok.text, stopped = handle.detok.push(tok.token_id)
                if stopped and seq_id not in finished:
                    seq = self.scheduler.finish(seq_id, FinishReason.STOP_SEQUENCE)
                    if seq is not None:
                        finished[seq_id] = seq
            handle.events.put(tok)  # the sampler's own object (see TokenEvent)
            if seq_id in finished:
                seq = finished[seq_id]
                with self._lock:
                    self._requests.pop(seq_id, None)
                self.kv_budget.release(seq_id)
                handle.events.put(FinishEvent(
                    seq.finish_reason, seq.num_prompt_tokens, seq.num_output_tokens,
                    handle.detok.text if handle.detok else "",
                    handle.first_token_ns - handle.submitted_ns, now_ns - handle.submitted_ns))
        for listener in tuple(self.step_listeners):  # the step first, then the requests it ended
            listener.on_step_done(plan, result)
            for seq_id in finished:
                listener.on_request_done(seq_id)
        self._outputs_done()

    def _outputs_done(self) -> None:
        if self.output_listeners:
            for listener in tuple(self.output_listeners):
                listener()

    def fail(self, exc: Exception) -> None:
        """Stop serving: every request ends with UNAVAILABLE and the ids it produced. The loop
        thread calls it when a collective fails; another thread may too, while the loop thread is
        blocked in the coordinator (the node watchdog giving up on a lost node), and the loop's
        own call when its wait ends then finds nothing left to end."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = exc
            handles, self._requests = list(self._requests.values()), {}
        self.kv_budget.clear()
        log.error("engine stopped: %s", exc)
        for handle in handles:
            for listener in tuple(self.step_listeners):
                listener.on_request_done(handle.seq_id)
            handle.events.put(ErrorEvent(Unavailable(str(exc)), list(handle.seq.output_token_ids)))
        self._outputs_done()
