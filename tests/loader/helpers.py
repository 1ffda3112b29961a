"""Shared by the loader tests: ranks built in-process, bitwise comparisons, a scoring rank."""

from __future__ import annotations

from pathlib import Path

import torch

from services.loader.layout import rank_model
from services.modeling.config import ModelConfig
from services.modeling.llama import LlamaForCausalLM
from services.modeling.parallel.coordinator import Coordinator
from services.modeling.parallel.groups import init_parallel_groups
from services.modeling.parallel.plan import ParallelPlan
from services.modeling.weights import CheckpointReader, load_weights
from services.quality.comparison import ScoreResult
from services.worker.rank_loading import load_checkpoint_weights, plan_for_checkpoint
from services.worker.runtime import LOAD_BARRIER_TIMEOUT_S, RankRuntime
from services.worker.scoring import prefill_logprobs

SENTINEL = 12345.0


def plan_of(model_dir: Path, tp: int, pp: int, dtype: str = "float32") -> ParallelPlan:
    return ParallelPlan(ModelConfig.from_dir(model_dir), tp, pp, dtype)


def hf_rank(model_dir: Path, plan: ParallelPlan, rank: int) -> LlamaForCausalLM:
    """Rank ``rank`` loaded from the HF directory by the worker's own loader (the reference)."""
    model = rank_model(plan, rank, device="cpu")
    with CheckpointReader(model_dir) as reader:
        load_weights(model, reader, tie_word_embeddings=plan.config.tie_word_embeddings)
    return model


def sentinel_rank(plan: ParallelPlan, rank: int) -> LlamaForCausalLM:
    """A rank whose every weight holds SENTINEL, to prove a refused shard never touched it."""
    model = rank_model(plan, rank, device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(SENTINEL)
    return model


def untouched(model: LlamaForCausalLM) -> bool:
    return all(bool((p == SENTINEL).all()) for p in model.parameters())


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def state_dict_diffs(a: LlamaForCausalLM, b: LlamaForCausalLM) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return [f"keys differ: {sorted(set(sa) ^ set(sb))}"]
    return [name for name in sa if not bitwise_equal(sa[name], sb[name])]


def score_from_checkpoint_rank(rank: int, world_size: int, checkpoint: str, tp: int, pp: int,
                               cache_dir: str | None, token_ids: list[int]) -> ScoreResult | None:
    """A rank of ``shardline score --checkpoint``, as RankRuntime.start will run it once wired:
    the plan from the manifest, the weights from this rank's verified shard."""
    plan = plan_for_checkpoint(checkpoint, tp_degree=tp, pp_degree=pp)
    groups = init_parallel_groups(plan, rank=rank)
    coordinator = Coordinator(groups, replica_group_id="ckpt", timeout_s=10.0)
    model = LlamaForCausalLM(plan, coordinator, device=groups.device)
    loaded = load_checkpoint_weights(model, plan, rank, checkpoint, cache_dir=cache_dir)
    model.eval()
    coordinator.barrier(timeout_s=LOAD_BARRIER_TIMEOUT_S)
    runtime = RankRuntime(plan, groups, coordinator, model, loaded, 0)
    return prefill_logprobs(runtime, token_ids if rank == 0 else None)


def score_from_staged_rank(rank: int, world_size: int, checkpoint: str, staged_paths: dict[int, str], tp: int,
                           pp: int, token_ids: list[int]) -> ScoreResult | None:
    """A rank that loads the shard a LoaderService ``Stage`` call put on this node
    (``staged_paths[rank]``), verified again against the manifest and the plan, then scores."""
    from services.loader.verify import read_manifest
    from services.worker.rank_loading import load_rank_shard

    manifest, _ = read_manifest(checkpoint)
    plan = plan_for_checkpoint(checkpoint, tp_degree=tp, pp_degree=pp)
    groups = init_parallel_groups(plan, rank=rank)
    coordinator = Coordinator(groups, replica_group_id="staged", timeout_s=10.0)
    model = LlamaForCausalLM(plan, coordinator, device=groups.device)
    loaded = load_rank_shard(model, manifest, staged_paths[rank], plan, rank)
    model.eval()
    coordinator.barrier(timeout_s=LOAD_BARRIER_TIMEOUT_S)
    runtime = RankRuntime(plan, groups, coordinator, model, loaded, 0)
    return prefill_logprobs(runtime, token_ids if rank == 0 else None)
