"""Shadow traffic: live completions mirrored to candidate replica groups, compared token by token.

A fraction (``ShadowConfig.fraction``) of the requests the router streams is picked when the
request arrives; when a picked request has FINISHED normally (EOS, a stop string, or its length:
not cancelled, not failed, and never continued on another group after a failover, so that every
logprob came from one incumbent group), ``Generation.close`` hands :meth:`ShadowMirror.offer` a
:class:`ShadowJob`: the prompt ids, the generated ids and the logprob the incumbent gave each
generated token (the worker's raw logprob: log_softmax of the unmodified logits). ``offer`` is
O(1) and never blocks: a full queue drops the job and counts it. The client's stream has ended by
then, so mirroring adds no latency to it.

The mirror's own thread scores each job on every candidate with the candidate worker's ``Score``
(teacher forcing on prompt + the incumbent's tokens, ``top_logprobs=1`` for the candidate's
argmax) and appends the generated positions to the rolling window of the pair (incumbent,
candidate): at most ``window_tokens`` positions, the newest. The window's figures use the
golden-set comparison's definitions (``services.quality.comparison``), on the
mirrored tokens only (prompt positions are not compared: the incumbent never scored them):

- perplexity delta, ``100 * (ppl_candidate / ppl_incumbent - 1)``;
- mean ``|Δ logprob|`` over the positions;
- top-1 agreement, the share of positions where the candidate's argmax is the incumbent's token.
  Counted on greedy requests only (temperature 0, where the incumbent's token is its argmax);
  a sampled token says nothing of the incumbent's argmax. NaN until a greedy request was mirrored.

**The prompt window.** The incumbent's tokens are its own choices, where its logprobs are high
by construction, so on them any other plan looks worse: the generated window's perplexity delta
is biased upward whichever group is the incumbent (bfloat16 vs int8 on SmolLM2: +0.9 % one way,
+0.15 % the other, where the golden-set gate measures +0.19 %). The prompt is the client's own
text, chosen by neither group. So (``judge="prompt"``, the default) the incumbent's worker also
``Score``s the prompt, and a second window per pair holds the prompt positions of both groups:
a perplexity delta on live text of the kind the gate measures on the golden set, and the one the
alert is judged on. ``judge="generated"`` skips that Score and judges the generated window.

**Only between a group's requests.** A worker runs a ``Score`` between its engine steps, so a
prefill of a mirrored request on a group that is decoding delays every stream there by that
long. The mirror therefore scores a job only once every group it needs (the candidates, and the
incumbent for the prompt) has none of this router's requests in flight, waiting up to
``idle_wait_s`` for that; a job that waited longer is dropped and counted like one that found the
queue full. ``idle_wait_s`` 0 scores at once, whatever the groups are doing. While a Score runs
on a group, the router's pick sends new requests to another group that can take them.

Candidates: ``ShadowConfig.candidate_group_ids`` when given (the incumbent itself excluded), else
every other routable group serving the same model whose plan (dtype, tp, pp) differs from the
incumbent's. A named candidate that is unknown, unroutable or serves another model is skipped.

Once a pair's window holds ``min_tokens`` positions and ``|perplexity delta|`` exceeds
``threshold_pct`` (either sign: a candidate that computes another distribution diverges whichever
way its perplexity moves), one SHADOW_DIVERGENCE alert names the CANDIDATE group (reference: the
incumbent); the next comes only after the window has gone back under the threshold. An alert
that cannot be delivered (telemetry down) is logged, counted and tried again after
``ALERT_RETRY_S``; the mirror keeps going.

No gRPC here: ``Score`` and the alert are callables (``process.py`` wires the worker client and
the telemetry client); metrics go to a :class:`ShadowObserver`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import InvalidArgument
from services.common.group_status import GroupStatus
from services.quality.shadow_window import ShadowWindow, WindowFigures
from services.router.replicas import ReplicaGroupView, ReplicaSet
from services.telemetry.rules import Alert, AlertKind

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 64
DEFAULT_WINDOW_TOKENS = 4096
DEFAULT_MIN_TOKENS = 512
DEFAULT_THRESHOLD_PCT = 0.5
JUDGES = ("prompt", "generated")  # which of a pair's windows the alert is judged on
DEFAULT_IDLE_WAIT_S = 5.0
IDLE_POLL_S = 0.01
ALERT_RETRY_S = 10.0  # between attempts to deliver a pair's alert while telemetry is unreachable


@dataclass(frozen=True)
class ShadowConfig:
    """What to mirror and when to call a candidate divergent. ``fraction`` 0 turns shadowing off."""

    fraction: float = 0.0
    candidate_group_ids: tuple[str, ...] = ()
    queue_size: int = DEFAULT_QUEUE_SIZE
    window_tokens: int = DEFAULT_WINDOW_TOKENS
    min_tokens: int = DEFAULT_MIN_TOKENS
    threshold_pct: float = DEFAULT_THRESHOLD_PCT
    seed: int | None = None
    score_timeout_s: float = 60.0
    judge: str = "prompt"
    idle_wait_s: float = DEFAULT_IDLE_WAIT_S

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise InvalidArgument(f"--shadow-fraction must be in [0, 1], got {self.fraction}")
        if self.queue_size < 1:
            raise InvalidArgument(f"--shadow-queue must be >= 1, got {self.queue_size}")
        if self.window_tokens < 1:
            raise InvalidArgument(f"--shadow-window-tokens must be >= 1, got {self.window_tokens}")
        if not 1 <= self.min_tokens <= self.window_tokens:
            raise InvalidArgument(f"--shadow-min-tokens must be in [1, --shadow-window-tokens "
                                  f"{self.window_tokens}], got {self.min_tokens}")
        if not self.threshold_pct >= 0.0:  # NaN too
            raise InvalidArgument(f"--shadow-threshold-pct must be >= 0, got {self.threshold_pct}")
        if not self.idle_wait_s >= 0.0:
            raise InvalidArgument(f"--shadow-idle-wait must be >= 0, got {self.idle_wait_s}")
        if self.judge not in JUDGES:
            raise InvalidArgument(f"--shadow-judge is one of {', '.join(JUDGES)}, got {self.judge!r}")
        if self.score_timeout_s <= 0:
            raise InvalidArgument(f"shadow score timeout must be > 0, got {self.score_timeout_s}")

    @property
    def enabled(self) -> bool:
        return self.fraction > 0.0


@dataclass(frozen=True)
class ShadowJob:
    """One finished request to mirror: ``incumbent_logprobs[j]`` is the incumbent's logprob of
    ``generated_ids[j]``; ``greedy``: sampled at temperature 0."""

    request_id: str
    model: str
    incumbent: str  # replica group id
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    incumbent_logprobs: tuple[float, ...]
    greedy: bool

    def __post_init__(self) -> None:
        if len(self.generated_ids) != len(self.incumbent_logprobs):
            raise ValueError(f"{len(self.generated_ids)} generated ids but {len(self.incumbent_logprobs)} logprobs")


class CandidateScore(Protocol):
    """A worker's Score answer: ``logprobs[i]`` of token ``i+1``; ``top_logprobs[i]`` its
    alternatives there, most likely first."""

    logprobs: Sequence[float]
    top_logprobs: Sequence[Sequence[tuple[int, float]]]


# (candidate's WorkerService address, request id, token ids, top logprobs, timeout s) -> its Score
ScoreFn = Callable[[str, str, list[int], int, float], CandidateScore]
# delivers an alert to telemetry; raises on failure
AlertFn = Callable[[Alert], None]


def generated_positions(job: ShadowJob, score: CandidateScore) -> tuple[list[float], list[int]]:
    """The candidate's logprob and argmax at each generated token of ``job``: token
    ``len(prompt) + j`` is predicted at position ``len(prompt) + j - 1`` of the scored ids."""
    start = len(job.prompt_ids) - 1
    end = start + len(job.generated_ids)
    if len(score.logprobs) < end or len(score.top_logprobs) < end:
        raise ValueError(f"the candidate scored {len(score.logprobs)} positions, {end} needed")
    logprobs = [float(lp) for lp in score.logprobs[start:end]]
    argmax = [alternatives[0][0] if alternatives else -1 for alternatives in score.top_logprobs[start:end]]
    return logprobs, argmax


class ShadowObserver(Protocol):
    """Where the mirror's counts go (``metrics.ShadowMetrics``: Prometheus)."""

    def dropped(self) -> None: ...

    def scored(self, incumbent: str, candidate: str, outcome: str, tokens: int) -> None: ...

    def window(self, incumbent: str, candidate: str, figures: WindowFigures) -> None: ...

    def prompt_window(self, incumbent: str, candidate: str, figures: WindowFigures) -> None: ...

    def alert(self, incumbent: str, candidate: str, outcome: str) -> None: ...


@dataclass
class _PairState:
    window: ShadowWindow  # the generated positions
    prompt_window: ShadowWindow  # the prompt positions (judge="prompt")
    alerted: bool = False  # an alert was delivered since the window last was under the threshold
    retry_at: float = 0.0  # monotonic time before which a failed alert is not tried again


class ShadowMirror:
    """The bounded queue of :class:`ShadowJob` and the thread that scores them (module docstring)."""

    def __init__(self, config: ShadowConfig, replicas: ReplicaSet, score: ScoreFn, *,
                 observer: ShadowObserver | None = None, raise_alert: AlertFn | None = None) -> None:
        self.config = config
        self.replicas = replicas
        self.score = score
        self.observer = observer
        self.raise_alert = raise_alert
        self._rng = random.Random(config.seed)
        self._queue: queue.Queue[ShadowJob | None] = queue.Queue(maxsize=config.queue_size)
        self._pairs: dict[tuple[str, str], _PairState] = {}
        self._lock = threading.Lock()  # guards _pairs and the counters for readers on other threads
        self.offered = self.dropped = self.compared = self.failed = self.skipped = 0
        self.alerts_raised = self.alerts_failed = 0
        self.busy = 0  # of the dropped: the groups stayed busy for idle_wait_s
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="shadow-mirror", daemon=True)
        self._started = False

    def start(self) -> ShadowMirror:
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after the job at hand; queued jobs are dropped (not counted)."""
        if not self._started:
            return
        self._stopping = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join(timeout_s)

    @property
    def queue_depth(self) -> int:
        """Jobs waiting, the one being scored included (the queue's count of unfinished tasks)."""
        return self._queue.unfinished_tasks

    def idle(self) -> bool:
        """Nothing queued and nothing being scored."""
        return not self._queue.unfinished_tasks

    def wants(self) -> bool:
        """Whether to mirror the request arriving now (one draw of the seeded generator)."""
        return self.config.fraction >= 1.0 or self._rng.random() < self.config.fraction

    def offer(self, job: ShadowJob) -> bool:
        """Queue ``job`` unless the queue is full (then dropped and counted); never blocks."""
        self.offered += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            if self.observer is not None:
                self.observer.dropped()
            return False
        return True

    def windows(self) -> dict[tuple[str, str], WindowFigures]:
        """Each pair's figures, by (incumbent, candidate)."""
        with self._lock:
            return {pair: f for pair, state in self._pairs.items() if (f := state.window.figures()) is not None}

    def prompt_windows(self) -> dict[tuple[str, str], WindowFigures]:
        """Each pair's prompt-window figures, by (incumbent, candidate)."""
        with self._lock:
            return {pair: f for pair, state in self._pairs.items()
                    if (f := state.prompt_window.figures()) is not None}

    # ---- the mirror's thread ----------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self.process(job)
            except Exception:  # noqa: BLE001 - the mirror must outlive any one job
                log.exception("shadow: request %s could not be mirrored", job.request_id)
            finally:
                self._queue.task_done()

    def candidates(self, job: ShadowJob) -> list[tuple[str, str]]:
        """(group id, address) of each group ``job`` is mirrored to; counts the skipped ones."""
        with self.replicas.lock:
            incumbent = self.replicas.by_group_id(job.incumbent)
            if self.config.candidate_group_ids:
                chosen, skipped = [], []
                for gid in self.config.candidate_group_ids:
                    if gid == job.incumbent:
                        continue
                    view = self.replicas.by_group_id(gid)
                    if view is None or not view.routable or view.model != job.model:
                        skipped.append(gid)
                    else:
                        chosen.append((gid, view.address))
            else:
                skipped = []
                chosen = [(v.replica_group_id, v.address) for v in self.replicas.for_model(job.model)
                          if v.routable and v.replica_group_id != job.incumbent
                          and (incumbent is None or _plan(v) != _plan(incumbent))]
        for gid in skipped:
            self._count("skipped", job.incumbent, gid, 0)
        return chosen

    def process(self, job: ShadowJob) -> None:
        """Score ``job`` on each candidate and update the pairs' windows (the thread's work)."""
        if not job.generated_ids:
            return
        ids = [*job.prompt_ids, *job.generated_ids]
        candidates = self.candidates(job)
        if not candidates:
            return
        judge_prompt = self.config.judge == "prompt"
        if not self._wait_idle([*([job.incumbent] if judge_prompt else []), *(gid for gid, _ in candidates)]):
            self.busy += 1
            self.dropped += 1
            if self.observer is not None:
                self.observer.dropped()
            return
        prompt = self._incumbent_prompt(job) if judge_prompt else None
        for candidate, address in candidates:
            try:
                with self._scoring(candidate):
                    answer = self.score(address, f"shadow-{job.request_id}", ids, 1, self.config.score_timeout_s)
                logprobs, argmax = generated_positions(job, answer)
                prompt_pair = (prompt, [float(lp) for lp in answer.logprobs[:len(prompt)]]) if prompt else None
            except Exception as exc:  # noqa: BLE001 - any failure of the candidate is counted, not raised
                log.warning("shadow: scoring request %s on %s (%s) failed: %s", job.request_id, candidate,
                            address, exc)
                self._count("failed", job.incumbent, candidate, 0)
                continue
            agreement = [a == t for a, t in zip(argmax, job.generated_ids)] if job.greedy else None
            self._count("compared", job.incumbent, candidate, len(logprobs))
            self._update(job.incumbent, candidate, job.incumbent_logprobs, logprobs, agreement, prompt_pair)

    @contextlib.contextmanager
    def _scoring(self, group_id: str) -> Iterator[None]:
        """Marks ``group_id`` as running a shadow Score, so that new requests go elsewhere meanwhile."""
        with self.replicas.lock:
            view = self.replicas.by_group_id(group_id)
            if view is not None:
                view.shadow_scores += 1
        try:
            yield
        finally:
            if view is not None:
                with self.replicas.lock:
                    view.shadow_scores -= 1

    def _idle(self, group_ids: Sequence[str]) -> bool:
        """None of this router's requests is in flight on any of ``group_ids``."""
        with self.replicas.lock:
            views = [self.replicas.by_group_id(gid) for gid in group_ids]
        return all(view is None or view.kv_bytes_reserved == 0 for view in views)

    def _wait_idle(self, group_ids: Sequence[str]) -> bool:
        """Whether ``group_ids`` went idle within ``idle_wait_s`` (at once when it is 0)."""
        if self.config.idle_wait_s <= 0:
            return True
        deadline = time.monotonic() + self.config.idle_wait_s
        while not self._idle(group_ids):
            if time.monotonic() >= deadline or self._stopping:
                return False
            time.sleep(IDLE_POLL_S)
        return True

    def _incumbent_prompt(self, job: ShadowJob) -> list[float] | None:
        """The incumbent's logprobs of the prompt's tokens (its worker's Score), or None (a prompt
        of one token, an incumbent gone or failing: the job then feeds the generated window only)."""
        if len(job.prompt_ids) < 2:
            return None
        with self.replicas.lock:
            view = self.replicas.by_group_id(job.incumbent)
        if view is None:
            return None
        try:
            with self._scoring(job.incumbent):
                answer = self.score(view.address, f"shadow-{job.request_id}-incumbent", list(job.prompt_ids), 0,
                                    self.config.score_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the generated window is still worth filling
            log.warning("shadow: scoring the prompt of %s on its incumbent %s failed: %s", job.request_id,
                        job.incumbent, exc)
            return None
        logprobs = [float(lp) for lp in answer.logprobs]
        return logprobs if len(logprobs) == len(job.prompt_ids) - 1 else None

    def _count(self, outcome: str, incumbent: str, candidate: str, tokens: int) -> None:
        with self._lock:
            if outcome == "compared":
                self.compared += 1
            elif outcome == "failed":
                self.failed += 1
            else:
                self.skipped += 1
        if self.observer is not None:
            self.observer.scored(incumbent, candidate, outcome, tokens)

    def _update(self, incumbent: str, candidate: str, incumbent_logprobs: Sequence[float],
                candidate_logprobs: Sequence[float], agreement: Sequence[bool] | None,
                prompt: tuple[Sequence[float], Sequence[float]] | None = None) -> None:
        """One job's positions into the pair's windows; ``prompt``: (incumbent's, candidate's)
        logprobs of the prompt tokens, when the incumbent scored them."""
        with self._lock:
            state = self._pairs.get((incumbent, candidate))
            if state is None:
                size = self.config.window_tokens
                state = self._pairs[(incumbent, candidate)] = _PairState(ShadowWindow(size), ShadowWindow(size))
            state.window.add(incumbent_logprobs, candidate_logprobs, agreement)
            figures = state.window.figures()
            if prompt is not None:
                state.prompt_window.add(*prompt)
            prompt_figures = state.prompt_window.figures()
        assert figures is not None
        if self.observer is not None:
            self.observer.window(incumbent, candidate, figures)
            if prompt is not None and prompt_figures is not None:
                self.observer.prompt_window(incumbent, candidate, prompt_figures)
        judged = figures if self.config.judge == "generated" else prompt_figures
        if judged is not None:
            self._judge(incumbent, candidate, state, judged)

    def _judge(self, incumbent: str, candidate: str, state: _PairState, figures: WindowFigures) -> None:
        if figures.tokens < self.config.min_tokens:
            return
        if not abs(figures.perplexity_delta_pct) > self.config.threshold_pct:
            state.alerted = False  # back under: the next crossing alerts again
            return
        if state.alerted or self.raise_alert is None or time.monotonic() < state.retry_at:
            return
        alert = divergence_alert(incumbent, candidate, figures, self.config.threshold_pct, positions=self.config.judge)
        try:
            self.raise_alert(alert)
        except Exception as exc:  # noqa: BLE001 - telemetry down must not stop the mirror
            state.retry_at = time.monotonic() + ALERT_RETRY_S
            self.alerts_failed += 1
            log.warning("shadow: could not raise the divergence alert for %s: %s", candidate, exc)
            if self.observer is not None:
                self.observer.alert(incumbent, candidate, "failed")
            return
        state.alerted = True
        self.alerts_raised += 1
        log.warning("shadow: %s", alert.message)
        if self.observer is not None:
            self.observer.alert(incumbent, candidate, "raised")


def _plan(view: ReplicaGroupView) -> tuple[str, int, int]:
    return view.dtype, view.tp_degree, view.pp_degree


def divergence_alert(incumbent: str, candidate: str, figures: WindowFigures, threshold_pct: float, *,
                     positions: str = "generated") -> Alert:
    """The SHADOW_DIVERGENCE alert on ``candidate``, with the judged window's figures in its message."""
    top1 = ("" if math.isnan(figures.top1_agreement) else
            f", top-1 agreement {figures.top1_agreement:.4f} on {figures.greedy_tokens} greedy tokens")
    message = (f"replica group {candidate}: perplexity {figures.perplexity_delta_pct:+.3f} % vs {incumbent} on "
               f"{figures.tokens} mirrored {positions} positions (|Δ| over the {threshold_pct:g} % threshold); "
               f"mean |Δ logprob| {figures.mean_abs_logprob_delta:.4f}{top1}")
    return Alert(AlertKind.SHADOW_DIVERGENCE, candidate, "", "", GroupStatus.DEGRADED, message,
                 int(time.time() * 1000), perplexity_delta_pct=figures.perplexity_delta_pct,
                 threshold_pct=threshold_pct, reference=incumbent)
