"""StageRunner: one rank's share of a forward step, and the loop non-driver ranks run.

Every rank receives the same :class:`StepPlan`; stage 0 embeds the step's tokens, later stages
receive the previous stage's hidden states, every stage writes its layers' keys and values into
its own paged KV cache, and the last stage computes logits only for the rows that sample (the
last token of each sampling sequence). The last stage's TP rank 0 samples and returns a
:class:`StepResult`; the driver gets it directly (PP = 1) or over the result group.

A group on one GPU runs its decode-only steps through :class:`DecodeGraphs` (CUDA graphs, one
per batch-size and context bucket); prefill and mixed steps, and every step of a larger group
or on the CPU, run eagerly.
"""

from __future__ import annotations

import time

from services.modeling.config import torch_dtype
from services.worker.engine.batch import flatten
from services.worker.engine.cuda_graphs import DecodeGraphs
from services.worker.engine.kv_cache import KVCacheLayout, allocate_kv_cache
from services.worker.engine.sampler import Sampler
from services.worker.engine.step import StepPlan, StepResult, TokenEvent
from services.worker.runtime import RankRuntime
from services.worker.scoring import score_tokens

# How often an idle driver broadcasts a heartbeat plan. Ranks waiting for a plan allow this plus
# the collective timeout, so a dead or hung rank is noticed within seconds even with no traffic.
IDLE_HEARTBEAT_S = 0.5


class StageRunner:
    """``decode_graphs``: run decode-only steps from static buffers (:class:`DecodeGraphs`, for
    up to ``max_batch`` sequences of up to ``max_model_len`` tokens), captured into CUDA graphs
    on a GPU; the KV cache then has one scratch block past the layout's for the padded rows."""

    def __init__(self, rt: RankRuntime, layout: KVCacheLayout, *, decode_graphs: bool = False, max_batch: int = 256,
                 max_model_len: int | None = None) -> None:
        self.rt = rt
        self.block_size = layout.block_size
        self.num_blocks = layout.num_blocks
        # the layout's dtype (the cache config's, else the plan's) both sized and allocates the cache
        self.kv_cache_bytes = allocate_kv_cache(rt.model, layout.num_blocks + int(decode_graphs), layout.block_size,
                                                torch_dtype(layout.dtype), rt.device)
        self.sampler = Sampler()
        self.samples_here = rt.groups.global_rank == rt.groups.last_stage_leader
        self.graphs: DecodeGraphs | None = None
        if decode_graphs:
            max_len = max_model_len or rt.plan.config.max_position_embeddings
            self.graphs = DecodeGraphs(rt.model, max_batch=max_batch, max_blocks_per_seq=-(-max_len // self.block_size),
                                       block_size=self.block_size, scratch_block=layout.num_blocks,
                                       capture=rt.device.type == "cuda")

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run this rank's part of ``plan``; the sampling rank returns the sampled tokens."""
        rt, c, g = self.rt, self.rt.coordinator, self.rt.groups
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.fits(plan.seqs):
            out = self.sampler.sample(self.graphs.run(plan.seqs), plan.seqs)
            sampled = [TokenEvent(s.seq_id, tok, lp, top) for s, (tok, lp, top) in zip(plan.seqs, out)]
            return StepResult(plan.step_id, sampled, time.perf_counter() - t0)
        batch = flatten(plan.seqs, rt.device)
        if g.is_first_stage:
            hidden = rt.model(batch.positions, batch.meta, input_ids=batch.input_ids)
        else:
            incoming = c.recv((batch.num_rows, rt.plan.config.hidden_size), rt.plan.torch_dtype, g.pp_stage - 1)
            hidden = rt.model(batch.positions, batch.meta, hidden_states=incoming)
        if not g.is_last_stage:
            c.send(hidden, g.pp_stage + 1)
            return None
        rows = batch.sample_rows
        sampling = [s for s in plan.seqs if s.sample]
        if not rows:
            return StepResult(plan.step_id, [], time.perf_counter() - t0) if self.samples_here else None
        # all TP ranks take part in the all-gather; the sampler reads the model's dtype directly
        logits = rt.model.compute_logits(hidden[rows], float32=False)
        if not self.samples_here:
            return None
        out = self.sampler.sample(logits, sampling)
        sampled = [TokenEvent(s.seq_id, tok, lp, top) for s, (tok, lp, top) in zip(sampling, out)]
        return StepResult(plan.step_id, sampled, time.perf_counter() - t0)


def follower_loop(runner: StageRunner) -> None:
    """Every rank but the driver: receive a plan, run it, send the sample back; until "stop"."""
    c, g = runner.rt.coordinator, runner.rt.groups
    # the driver may spend a stage-boundary send/recv's timeout and its one retry before the next plan
    wait_s = IDLE_HEARTBEAT_S + 2 * c.timeout_s + 1.0
    while True:
        plan: StepPlan = c.broadcast_object(None, src=0, timeout_s=wait_s)
        if plan.kind == "stop":
            c.flush()
            return
        if plan.kind == "idle":
            continue
        if plan.kind == "score":
            score_tokens(runner.rt, plan.seqs[0].token_ids, plan.seqs[0].top_logprobs)
            continue
        result = runner.execute(plan)
        if result is not None and not g.is_driver:
            c.send_object(result, dst=0, deferred=True)
