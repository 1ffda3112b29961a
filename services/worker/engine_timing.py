"""Timing the serving engine as a client sees it: the seconds between a request's tokens.

The planner's calibration (``services.planner.calibrate``) takes :func:`engine_decode_steps_s`
as an argument to measure the engine's fixed costs per step and per layer; the planner bench
uses :func:`decode_intervals_s` to check the cost model against the engine.
"""

from __future__ import annotations

import queue
import statistics
import time
from typing import Any

from services.common.sampling import SamplingParams
from services.worker.engine.bootstrap import build_engine, start_rank
from services.worker.engine.engine import ErrorEvent, FinishEvent
from services.worker.engine.kv_cache import CacheConfig
from services.worker.engine.step import TokenEvent
from services.worker.runtime import RankSpec


def decode_intervals_s(engine: Any, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds between consecutive tokens of one greedy batch-1 request on a built engine (the
    first token, which the prefill produces, starts the clock): its decode steps as a client sees
    them. Drives the engine's loop itself to timestamp each token as it is produced."""
    handle = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    stamps: list[float] = []
    while True:
        progressed = engine.step()
        while True:
            try:
                event = handle.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, TokenEvent):
                stamps.append(time.perf_counter())
            elif isinstance(event, FinishEvent):
                return [b - a for a, b in zip(stamps, stamps[1:])]
            elif isinstance(event, ErrorEvent):
                raise event.error
        if not progressed:
            time.sleep(0.0005)


def engine_decode_steps_s(model_dirs: dict[int, str], *, prompt_tokens: int, decode_tokens: int,
                          rounds: int = 3) -> dict[int, float]:
    """Median decode step of the real serving engine (one rank) on each model, keyed like
    ``model_dirs``. The models' requests alternate, ``rounds`` each after a warm-up, so a burst
    of other work on the host lands on every depth alike instead of skewing the slope."""
    engines = {}
    for key, model_dir in model_dirs.items():
        spec = RankSpec(model_dir, cache=CacheConfig(kv_cache_bytes=16 << 20))
        runner, layout = start_rank(spec, 0)
        engines[key] = build_engine(spec, runner, layout)
    prompt = list(range(4, 4 + prompt_tokens))
    intervals: dict[int, list[float]] = {key: [] for key in engines}
    try:
        for engine in engines.values():
            decode_intervals_s(engine, prompt, 4)
        for _ in range(rounds):
            for key, engine in engines.items():
                intervals[key] += decode_intervals_s(engine, prompt, decode_tokens)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {key: statistics.median(values) for key, values in intervals.items()}
