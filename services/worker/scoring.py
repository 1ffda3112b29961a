"""Prompt scoring across a replica group: one prefill, per-token log-probabilities.

``logprobs[i] = log p(ids[i+1] | ids[..i])``; ``nll`` is their negated mean and ``perplexity``
``exp(nll)``. The driver broadcasts the ids; stage 0 embeds, each stage runs its layers and sends
the hidden states on; the last stage gathers the logits, and its TP rank 0 returns the numbers to
the driver.
"""

from __future__ import annotations

import torch

from services.modeling.attention import AttentionMetadata
from services.quality.comparison import ScoreResult
from services.worker.runtime import RankRuntime, RankSpec


def prefill_logprobs(rt: RankRuntime, token_ids: list[int] | None) -> ScoreResult | None:
    """Run on every rank; returns the result on the driver (global rank 0), None elsewhere."""
    return score_tokens(rt, rt.coordinator.broadcast_object(token_ids, src=0))


def score_tokens(rt: RankRuntime, ids: list[int], top_logprobs: int = 0) -> ScoreResult | None:
    """Every rank, once all know ``ids``: one prefill without the KV cache (it never touches the
    paged cache, so it can run between serving steps); ``top_logprobs`` alternatives per position."""
    c, g, model = rt.coordinator, rt.groups, rt.model
    n = len(ids)
    positions = torch.arange(n, device=rt.device)
    meta = AttentionMetadata.prefill([n])
    if g.is_first_stage:
        hidden = model(positions, meta, input_ids=torch.tensor(ids, device=rt.device))
    else:
        incoming = c.recv((n, rt.plan.config.hidden_size), rt.plan.torch_dtype, g.pp_stage - 1)
        hidden = model(positions, meta, hidden_states=incoming)
    if not g.is_last_stage:
        c.send(hidden, g.pp_stage + 1)
        result = None
    else:
        logits = model.compute_logits(hidden[:-1])
        targets = torch.tensor(ids[1:], device=logits.device)
        log_softmax = torch.log_softmax(logits, dim=-1)
        logprobs = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
        top = None
        if top_logprobs > 0:
            values, indices = log_softmax.topk(min(top_logprobs, log_softmax.shape[-1]), dim=-1)
            top = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
        result = ScoreResult.from_logprobs(n, logprobs.cpu().tolist(), log_softmax.argmax(-1).cpu().tolist(), top)
    last_leader = g.last_stage_leader
    if last_leader == 0:
        return result if g.is_driver else None
    if g.global_rank == last_leader:
        c.send_object(result, dst=0)
        return None
    if g.is_driver:
        return c.recv_object(src=last_leader)
    return None


def score_rank(rank: int, world_size: int, spec: RankSpec, token_ids: list[int]) -> ScoreResult | None:
    """Rank entry point for ``shardline score`` (spawned locally or under torchrun)."""
    rt = RankRuntime.start(spec, rank)
    return prefill_logprobs(rt, token_ids if rank == 0 else None)


def score_chunks_rank(rank: int, world_size: int, spec: RankSpec,
                      chunks: list[list[int]]) -> list[ScoreResult] | None:
    """Rank entry point that scores many chunks in one start of the group (``shardline compare``):
    each chunk is an independent prompt."""
    rt = RankRuntime.start(spec, rank)
    results = [score_tokens(rt, chunk) for chunk in chunks]  # every rank was handed the chunks
    return results if rank == 0 else None
