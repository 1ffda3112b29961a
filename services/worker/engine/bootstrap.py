"""Starting a serving replica group: every rank builds its runner; the driver builds the engine.

``RankSpec`` is what each rank needs (picklable, it crosses the spawn). The driver then either
serves (``shardline serve worker``) or runs a batch of requests to completion (``shardline
generate``, tests, benchmarks); every other rank runs :func:`follower_loop` until told to stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from services.common.collective_events import EventSink
from services.common.sampling import SamplingParams
from services.modeling.config import ModelConfigError
from services.worker.engine.engine import ErrorEvent, FinishEvent, LLMEngine
from services.worker.engine.kv_cache import KVCacheLayout
from services.worker.engine.runner import StageRunner, follower_loop
from services.worker.engine.step import TokenEvent
from services.worker.runtime import LOAD_BARRIER_TIMEOUT_S, RankRuntime, RankSpec, stage_tokenizer_dir


def load_tokenizer(model_dir: str | None) -> Tokenizer | None:
    if not model_dir:
        return None
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.exists() else None


def encode_prompt(model_dir: str | None, text: str) -> list[int]:
    """``text`` in the model's tokenizer.json (for the CLI's --prompt/--text)."""
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ModelConfigError(f"{Path(model_dir or '.') / 'tokenizer.json'} not found: pass --ids, "
                               f"or give the model a tokenizer.json")
    return tokenizer.encode(text).ids


def start_rank(spec: RankSpec, rank: int, *, sink: EventSink | None = None) -> tuple[StageRunner, KVCacheLayout]:
    rt = RankRuntime.start(spec, rank, sink=sink)
    layout = KVCacheLayout.for_plan(rt.plan, spec.cache)
    # CUDA graphs hold no collectives: a group of one GPU
    graphs = spec.cuda_graphs and rt.device.type == "cuda" and rt.plan.world_size == 1
    runner = StageRunner(rt, layout, decode_graphs=graphs, max_batch=spec.max_num_seqs,
                         max_model_len=spec.scheduler_config().max_model_len)
    # every rank holds its KV cache before the driver serves: zero-filling a cache takes each rank
    # its own time (4 ranks filling 1 GiB each on 2 cores: over 8 s for one of them), and the first
    # step's broadcast would otherwise wait that out against the collective timeout
    rt.coordinator.barrier(timeout_s=LOAD_BARRIER_TIMEOUT_S)
    return runner, layout


def build_engine(spec: RankSpec, runner: StageRunner, layout: KVCacheLayout) -> LLMEngine:
    return LLMEngine(runner, layout, tokenizer=load_tokenizer(stage_tokenizer_dir(spec)),
                     scheduler_config=spec.scheduler_config())


@dataclass
class Completion:
    """One finished request, as ``shardline generate --json`` prints it."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    prompt_tokens: int

    def to_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "logprobs": self.logprobs,
                "finish_reason": self.finish_reason}


def generate_rank(rank: int, world_size: int, spec: RankSpec, prompts: list[list[int]],
                  params: list[SamplingParams]) -> list[Completion] | None:
    """Rank entry point: run ``prompts`` to completion as one batch; the driver returns them."""
    runner, layout = start_rank(spec, rank)
    if rank != 0:
        follower_loop(runner)
        return None
    engine = build_engine(spec, runner, layout)
    handles = [engine.submit(ids, p) for ids, p in zip(prompts, params, strict=True)]
    engine.run_until_done()
    engine.shutdown()
    return [collect(handle) for handle in handles]


def collect(handle) -> Completion:
    ids, logprobs = [], []
    while True:
        event = handle.events.get_nowait()
        if isinstance(event, TokenEvent):
            ids.append(event.token_id)
            logprobs.append(event.logprob)
        elif isinstance(event, FinishEvent):
            return Completion(ids, event.text, logprobs, event.reason.value, event.prompt_tokens)
        elif isinstance(event, ErrorEvent):
            raise event.error
