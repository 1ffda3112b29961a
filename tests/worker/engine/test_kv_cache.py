"""KV-cache sizing (exact bytes and block counts) and allocation; and the allocator + scheduler +
KV cache driving the real model: paged logits equal a no-cache full forward."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling import SamplingParams
from services.modeling.attention import AttentionMetadata
from services.modeling.config import ModelConfig
from services.modeling.llama import LlamaForCausalLM
from services.modeling.parallel.coordinator import Coordinator
from services.modeling.parallel.groups import ParallelGroups
from services.modeling.parallel.plan import ParallelPlan
from services.worker.engine.batch import flatten
from services.worker.engine.block_manager import BlockAllocator
from services.worker.engine.kv_cache import (
    CacheConfig,
    GiB,
    KVCacheLayout,
    KVCacheTooSmall,
    allocate_kv_cache,
    free_kv_cache,
    kv_bytes_per_token_per_rank,
    num_blocks_for_budget,
)
from services.worker.engine.scheduler import Scheduler, SchedulerConfig
from services.worker.engine.sequence import Sequence

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

LLAMA3_70B = ModelConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, head_dim=128)
TINY = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=96, head_dim=16, max_position_embeddings=256)


def test_design_numbers_for_llama3_70b() -> None:
    """Llama-3-70B: 327,680 B/token unsharded fp16 (2·80·8·128·2); 40,960 at TP4/PP2; 20 GiB holds
    524,288 tokens per GPU shard."""
    assert kv_bytes_per_token_per_rank(ParallelPlan(LLAMA3_70B, 1, 1, "float16"), 0) == 327_680
    plan = ParallelPlan(LLAMA3_70B, tp_degree=4, pp_degree=2, dtype="float16")
    assert [kv_bytes_per_token_per_rank(plan, s) for s in (0, 1)] == [40_960, 40_960]
    layout = KVCacheLayout.for_plan(plan, CacheConfig())
    assert (layout.num_blocks, layout.capacity_tokens) == (32_768, 524_288)
    assert layout.capacity_bytes == 20 * GiB
    assert layout.capacity_tokens // 2048 == 256


def test_uneven_split_sizes_every_rank_from_the_fullest_stage() -> None:
    plan = ParallelPlan(TINY, tp_degree=2, pp_degree=2, dtype="float32")  # layers 3 + 2
    # 2 · layers · (2 kv heads / tp 2) · 16 · 4 bytes
    assert [kv_bytes_per_token_per_rank(plan, s) for s in (0, 1)] == [384, 256]
    cache = CacheConfig(block_size=4, kv_cache_bytes=384 * 4 * 10 + 100)
    assert num_blocks_for_budget(plan, cache) == 10  # stage 0 fills its budget; stage 1 uses 2/3
    layout = KVCacheLayout.for_plan(plan, cache)
    assert (layout.bytes_per_token, layout.bytes_per_block, layout.bytes_for_blocks(3)) == (384, 1536, 4608)


def test_tp_beyond_kv_heads_replicates_one_head_and_dtype_override() -> None:
    plan = ParallelPlan(TINY, tp_degree=4, pp_degree=1, dtype="float32")  # 2 kv heads, tp 4
    assert kv_bytes_per_token_per_rank(plan, 0) == 2 * 5 * 1 * 16 * 4
    assert kv_bytes_per_token_per_rank(plan, 0, dtype="bf16") == 2 * 5 * 1 * 16 * 2
    cache = CacheConfig(dtype="fp16", kv_cache_bytes=320 * 16 * 2 + 319)  # fp16: 320 B/token
    assert cache.dtype == "float16" and cache.resolved_dtype(plan) == "float16"
    assert num_blocks_for_budget(plan, cache) == 2


def test_budget_too_small_and_override() -> None:
    plan = ParallelPlan(TINY, 1, 1, "float32")
    with pytest.raises(KVCacheTooSmall, match=r"kv_cache_bytes=1000 holds no KV block: one block of 16 tokens "
                                              r"needs 20480 bytes on the fullest stage \(1280 bytes per token\)"):
        num_blocks_for_budget(plan, CacheConfig(kv_cache_bytes=1000))
    assert num_blocks_for_budget(plan, CacheConfig(kv_cache_bytes=1000, num_blocks=7)) == 7
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="pp_stage must be in"):
        kv_bytes_per_token_per_rank(plan, 1)


def rank_model(plan: ParallelPlan, global_rank: int, device: str) -> LlamaForCausalLM:
    groups = ParallelGroups(plan.tp_degree, plan.pp_degree, global_rank, "none", None, None, None)
    return LlamaForCausalLM(plan, Coordinator(groups), device=device)


def test_allocate_kv_cache_shapes_and_bytes_for_a_stage_shard() -> None:
    plan = ParallelPlan(TINY, tp_degree=2, pp_degree=2, dtype="bfloat16")
    model = rank_model(plan, global_rank=3, device="meta")  # stage 1 (layers 3, 4), tp rank 1
    nbytes = allocate_kv_cache(model, 6, 4, torch.bfloat16, "cpu")
    layers = model.attention_layers()
    assert len(layers) == 2
    for layer in layers:
        k, v = layer.kv_cache
        assert k.shape == v.shape == (6, 4, 1, 16) and k.dtype == torch.bfloat16
        assert k.count_nonzero() == 0  # zero-filled: masked garbage must not be NaN
    assert nbytes == 6 * 4 * kv_bytes_per_token_per_rank(plan, 1)
    free_kv_cache(model)
    assert all(layer.kv_cache is None for layer in layers)


def _random_model(plan: ParallelPlan) -> LlamaForCausalLM:
    model = rank_model(plan, 0, "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _full_forward_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Last-position logits of a no-cache forward over the whole context (the reference)."""
    saved = [layer.kv_cache for layer in model.attention_layers()]
    free_kv_cache(model)
    try:
        hidden = model(torch.arange(len(ids)), AttentionMetadata.prefill([len(ids)]),
                       input_ids=torch.tensor(ids))
        return model.compute_logits(hidden[-1:])[0]
    finally:
        for layer, cache in zip(model.attention_layers(), saved, strict=True):
            layer.kv_cache = cache


def test_paged_steps_match_a_full_forward() -> None:
    """Chunked prefill, mixed batches, block-boundary growth and a preemption/recompute: every
    sampled row's logits equal a no-cache forward over the same context, and greedy outputs
    equal each request run alone."""
    plan = ParallelPlan(TINY, 1, 1, "float32")
    model = _random_model(plan)
    block_size = 4
    allocator = BlockAllocator(num_blocks=12, block_size=block_size)
    allocate_kv_cache(model, allocator.num_blocks, block_size, torch.float32, "cpu")
    sched = Scheduler(allocator, SchedulerConfig(max_num_seqs=4, max_batched_tokens=10, max_model_len=64))
    prompts = {0: [5, 17, 33, 2, 8, 61, 40], 1: [9, 1, 70, 22, 13, 4, 4, 80, 31, 7, 19, 50, 3], 2: [42, 24]}
    for sid, prompt in prompts.items():
        sched.add(Sequence(sid, prompt, SamplingParams(temperature=0, max_tokens=12)))
    steps = preemptions = 0
    while sched.has_unfinished:
        out = sched.schedule()
        preemptions += len(out.preempted)
        assert not out.is_empty
        batch = flatten(out.scheduled)
        hidden = model(batch.positions, batch.meta, input_ids=batch.input_ids)
        logits = model.compute_logits(hidden[batch.sample_rows])
        sampled: dict[int, int | None] = {c.seq_id: None for c in out.scheduled}
        for row, sid in enumerate(c.seq_id for c in out.scheduled if c.sample):
            context = sched.get(sid).all_token_ids
            torch.testing.assert_close(logits[row], _full_forward_logits(model, context), rtol=1e-4, atol=1e-4)
            sampled[sid] = int(logits[row].argmax())
        sched.on_step_done(sampled)
        steps += 1
    assert preemptions > 0, "the scenario should exercise recompute"
    assert allocator.num_free_blocks == 12
