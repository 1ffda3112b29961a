"""The cost model: memory per GPU, KV capacity, collectives, time, money."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.planner.comm import Link, pp_boundary_links, ring_all_reduce_s, send_recv_s, tp_links
from services.planner.cost_model import (
    Candidate,
    CostModel,
    LayoutError,
    Workload,
    bubble_fraction,
    check_layout,
    stage_layer_counts,
)
from services.planner.specs import PRESETS, ModelSpec
from services.planner.topology import GIB, Topology
from services.planner.topology import PRESETS as TOPOLOGIES

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

LLAMA70 = PRESETS["llama3-70b"]
A100 = TOPOLOGIES["a100-80g-8x"]


def estimate(tp: int, pp: int, dtype: str = "float16", model: ModelSpec = LLAMA70, **workload):
    return CostModel(model, A100, Workload(**workload)).estimate(Candidate(tp, pp, dtype))


def test_seed_numbers_at_tp4_pp2() -> None:
    e = estimate(4, 2)
    assert e.kv_bytes_per_token_per_gpu == 2 * 40 * 2 * 128 * 2 == 40_960
    assert e.kv_tokens_per_gpu == 20 * GIB // 40_960 == 524_288
    assert e.max_concurrent_sequences == 524_288 // 2048 == 256
    assert e.kv_heads_per_rank == 2 and e.kv_replication == 1
    assert [s.layers for s in e.stages] == [40, 40]


def test_weight_bytes_per_gpu_split_as_the_model_splits() -> None:
    e = estimate(4, 2)
    # one layer on one of 4 ranks: q 8192·2048, k and v 8192·256 each, o 2048·8192, MLP 3·8192·7168
    linear = 8192 * 2048 + 2 * 8192 * 256 + 2048 * 8192 + 3 * 8192 * 7168
    layer = 2 * linear + 2 * 2 * 8192  # fp16 weights + two replicated RMSNorm weights
    vocab_shard = 2 * (128256 // 4) * 8192
    stage0 = 40 * layer + vocab_shard  # vocab-parallel embedding on stage 0
    last = 40 * layer + vocab_shard + 2 * 8192  # lm_head shard and the final norm on the last stage
    assert [s.weight_bytes for s in e.stages] == [stage0, last]
    assert e.weight_bytes_per_gpu == last == 17_639_424_000
    # Memory left after weights, reserve and the 20 GiB KV cap.
    assert e.memory_left_bytes == 80 * GIB - last - 3 * GIB - 20 * GIB


def test_stage_weights_add_up_to_the_unsharded_model() -> None:
    # No KV replication, vocab divisible by TP, untied: every byte is somewhere exactly once.
    for tp, pp in [(1, 1), (2, 1), (4, 2), (8, 1), (1, 8), (2, 4)]:
        e = estimate(tp, pp)
        assert sum(s.weight_bytes for s in e.stages) * tp == LLAMA70.weight_bytes("float16") + (tp - 1) * (
            2 * 2 * 8192 * 80 + 2 * 8192  # norms are replicated on every TP rank
        )


def test_uneven_pp_is_accounted_on_the_fullest_stage() -> None:
    e = estimate(4, 3)  # 80 layers over 3 stages
    assert stage_layer_counts(80, 3) == (27, 27, 26)
    assert [s.layers for s in e.stages] == [27, 27, 26]
    # The 27-layer stages bind the KV cache: 2 · 27 · 2 · 128 · 2.
    assert e.kv_bytes_per_token_per_gpu == 27_648
    assert e.kv_tokens_per_gpu == 20 * GIB // 27_648 == 776_722
    assert e.max_concurrent_sequences == 379
    # Stage 0 (27 layers + embedding) is the fullest, not the 26-layer last stage with lm_head.
    assert e.weight_bytes_per_gpu == e.stages[0].weight_bytes > e.stages[2].weight_bytes
    even = estimate(4, 2)
    assert e.kv_bytes_per_token_per_gpu < even.kv_bytes_per_token_per_gpu


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    tp8 = estimate(8, 1)
    tp16 = estimate(16, 1)
    assert tp8.kv_heads_per_rank == 1 and tp8.kv_replication == 1
    assert tp16.kv_heads_per_rank == 1 and tp16.kv_replication == 2
    # Each GPU still stores a whole KV head: per-GPU KV per token does not halve again.
    assert tp16.kv_bytes_per_token_per_gpu == tp8.kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2
    # ... and the group as a whole stores twice the real cache.
    assert tp16.kv_bytes_per_token_per_gpu * 16 == 2 * LLAMA70.kv_bytes_per_token()
    # k_proj/v_proj weights are replicated too: 16 ranks hold 2 copies of each KV head's weights.
    kv_weight_per_layer = 2 * 8192 * 128 * 2
    q_o_mlp_per_layer = 2 * (2 * 8192 * 512 + 3 * 8192 * 1792)
    norms = 2 * 2 * 8192
    assert tp16.stages[0].weight_bytes == 80 * (kv_weight_per_layer + q_o_mlp_per_layer + norms) + 2 * (
        128256 // 16
    ) * 8192 * 2 + 2 * 8192


def test_layouts_that_cannot_split_the_model() -> None:
    smol = PRESETS["smollm2-135m"]  # 9 heads, 3 KV heads, intermediate 1536
    check_layout(smol, Candidate(3, 1, "float32"))
    with pytest.raises(LayoutError, match="tp 2 does not divide the 9 attention heads"):
        check_layout(smol, Candidate(2, 1, "float32"))
    with pytest.raises(LayoutError, match="tp 9 does not divide intermediate_size 1536"):
        check_layout(smol, Candidate(9, 1, "float32"))
    with pytest.raises(LayoutError, match="pp 31 exceeds the model's 30 layers"):
        check_layout(smol, Candidate(1, 31, "float32"))


def test_ring_all_reduce_matches_the_seed_formula() -> None:
    nvlink = Link("nvlink", 600e9, 1e-6)
    decode = ring_all_reduce_s(8192 * 2, 4, nvlink)
    assert decode == pytest.approx(2 * 3 / 4 * 16384 / 600e9 + 2 * 3 * 1e-6)
    prefill = ring_all_reduce_s(2048 * 8192 * 2, 4, nvlink)
    assert prefill == pytest.approx(2 * 3 / 4 * 2048 * 8192 * 2 / 600e9 + 6e-6)
    # decode is latency-bound, prefill bandwidth-bound
    assert 6e-6 / decode > 0.99 and 6e-6 / prefill < 0.2
    assert ring_all_reduce_s(1 << 20, 1, nvlink) == 0.0
    assert send_recv_s(16384, nvlink) == pytest.approx(1e-6 + 16384 / 600e9)


def test_links_follow_the_rank_layout() -> None:
    # TP8 inside one node rides NVLink; TP16 spans two nodes and rides the network.
    assert [link.name for link in tp_links(A100, 8, 2)] == ["nvlink", "nvlink"]
    assert [link.name for link in tp_links(A100, 16, 1)] == ["network"]
    # TP4/PP4 = 16 GPUs: the boundary between stage 1 (ranks 4-7) and stage 2 (8-11) crosses nodes.
    assert [link.name for link in pp_boundary_links(A100, 4, 4)] == ["nvlink", "network", "nvlink"]
    # TP3/PP3: stage 2 is ranks 6, 7, 8 and straddles the node boundary.
    assert [link.name for link in tp_links(A100, 3, 3)] == ["nvlink", "nvlink", "network"]


def test_cross_node_tp_is_slower() -> None:
    assert estimate(16, 1).all_reduce_decode_s > 10 * estimate(8, 1).all_reduce_decode_s


def test_time_model_at_batch_one() -> None:
    e = estimate(4, 2)
    # A decode step streams every weight but the embedding table (one row per token is gathered):
    # stage 0 holds the table but does not read it; the last stage reads its lm_head shard.
    vocab_shard_bytes = 128256 // 4 * 8192 * 2
    assert e.stages[0].read_bytes == e.stages[0].weight_bytes - vocab_shard_bytes
    assert e.stages[1].read_bytes == e.stages[1].weight_bytes
    stage_read = e.stages[1].read_bytes / A100.hbm_bandwidth_bytes_per_s
    assert e.weight_read_s == pytest.approx(stage_read)
    # A token visits both stages in turn: TPOT(1) ≥ the two stages' weight reads plus 160 all-reduces.
    floor = (e.stages[0].read_bytes + e.stages[1].read_bytes) / A100.hbm_bandwidth_bytes_per_s
    assert e.tpot_batch1_s > floor + 160 * e.all_reduce_decode_s
    assert e.tpot_batch1_s < 1.1 * (floor + 162 * e.all_reduce_decode_s)
    assert e.micro_batches == 2 and e.bubble_fraction == pytest.approx(1 / 3)


def test_money_follows_the_seeds_arithmetic() -> None:
    # At the 40 tok/s per sequence target, TP8/PP1 fp16: 256 · 40 = 10,240 tok/s on 8 GPUs.
    e = estimate(8, 1, seq_tokens_per_s=40.0)
    assert e.tokens_per_s_per_replica == 10_240
    assert e.gpu_hours_per_million_tokens == pytest.approx(8 * 1e6 / (10_240 * 3600))  # 0.217
    assert round(e.gpu_hours_per_million_tokens, 3) == 0.217
    assert round(e.usd_per_million_tokens, 2) == 0.61
    assert e.replicas_per_node == 1 and e.blast_radius_gpus == 8


def test_stranded_gpus_are_billed() -> None:
    # TP1/PP3 packs 2 replicas on an 8-GPU node; the 2 idle GPUs are paid for: 4 GPUs per replica.
    e = estimate(1, 3)
    assert e.replicas_per_node == 2 and e.billed_gpus_per_replica == 4.0


def test_infeasible_layout_reports_the_shortfall() -> None:
    e = estimate(2, 1)
    assert not e.fits
    assert e.shortfall_bytes == e.memory_needed_bytes - 80 * GIB > 0
    assert e.kv_budget_bytes == 80 * GIB - e.weight_bytes_per_gpu - 3 * GIB < 20 * GIB


# ---- properties ------------------------------------------------------------------------------


@given(st.integers(1, 64), st.integers(1, 256))
def test_bubble_fraction_is_monotone(pp: int, micro: int) -> None:
    b = bubble_fraction(pp, micro)
    assert 0 <= b < 1
    assert bubble_fraction(pp, micro + 1) <= b  # more micro-batches, smaller bubble
    assert bubble_fraction(pp + 1, micro) >= b  # more stages, bigger bubble
    assert (b == 0) == (pp == 1)


@given(st.integers(1, 200), st.integers(1, 200))
def test_stage_layer_counts(layers: int, pp: int) -> None:
    if pp > layers:
        with pytest.raises(LayoutError):
            stage_layer_counts(layers, pp)
        return
    counts = stage_layer_counts(layers, pp)
    assert sum(counts) == layers and len(counts) == pp
    assert max(counts) - min(counts) <= 1
    assert counts[-1] == min(counts)  # the lm_head stage never takes an extra layer


models = st.builds(
    lambda layers, kv, group, hd, inter_mult, vocab, tied: ModelSpec(
        "prop", num_layers=layers, hidden_size=kv * group * hd, num_attention_heads=kv * group,
        num_key_value_heads=kv, head_dim=hd, intermediate_size=64 * inter_mult, vocab_size=vocab,
        tie_word_embeddings=tied,
    ),
    st.integers(1, 48), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.sampled_from([32, 64, 128]),
    st.integers(1, 64), st.integers(100, 200_000), st.booleans(),
)


@given(models, st.sampled_from([1, 2, 4, 8]), st.integers(1, 8), st.sampled_from(["float16", "float32", "int8"]),
       st.integers(1, 40), st.sampled_from([256, 2048, 8192]))
def test_kv_tokens_never_exceed_the_cap(model: ModelSpec, tp: int, pp: int, dtype: str, cap_gib: int,
                                        context: int) -> None:
    cand = Candidate(tp, pp, dtype)
    try:
        check_layout(model, cand)
    except LayoutError:
        return
    e = CostModel(model, A100, Workload(kv_cap_bytes=cap_gib * GIB, avg_context=context)).estimate(cand)
    assert e.kv_tokens_per_gpu * e.kv_bytes_per_token_per_gpu <= min(cap_gib * GIB, e.kv_budget_bytes)
    assert (e.kv_tokens_per_gpu + 1) * e.kv_bytes_per_token_per_gpu > e.kv_budget_bytes  # and use it all
    assert e.max_concurrent_sequences * context <= e.kv_tokens_per_gpu
    assert e.weight_bytes_per_gpu == max(s.weight_bytes for s in e.stages)
    # Sharding never loses a weight: the group holds at least the unsharded model.
    assert sum(s.weight_bytes for s in e.stages) * tp >= model.weight_bytes(dtype)


@given(st.sampled_from([(1, 1), (4, 2), (8, 1), (2, 4), (1, 8)]), st.integers(1, 300))
def test_tpot_grows_with_concurrency(layout: tuple[int, int], concurrency: int) -> None:
    cm = CostModel(LLAMA70, A100)
    cand = Candidate(*layout, "float16")
    assert cm.tpot_s(cand, concurrency + 1) >= cm.tpot_s(cand, concurrency) > 0


# ---- a calibrated CPU host: contention and the serving stack's fixed costs ---------------------

SMOLLM2 = PRESETS["smollm2-135m"]
CPU_HOST = Topology(
    name="host", gpus_per_node=3, gpu_memory_bytes=8 * GIB, nvlink_domain_size=3,
    intra_node_bandwidth_bytes_per_s=1e9, intra_node_latency_s=100e-6, inter_node_bandwidth_bytes_per_s=1e9,
    inter_node_latency_s=100e-6, hbm_bandwidth_bytes_per_s=10e9, peak_dense_flops=1e12,
    peak_dense_flops_fp32=1e12, usd_per_gpu_hour=0.04, reserve_bytes=GIB, device="cpu",
    step_overhead_s=1e-3, layer_overhead_s=200e-6, control_latency_s=300e-6,
    node_memory_bandwidth_bytes_per_s=20e9,
)


def test_contention_splits_a_shared_host() -> None:
    # Alone a rank streams 10 GB/s; the node streams 20 GB/s in all: two ranks fit, three share.
    assert [CPU_HOST.contention(k) for k in (1, 2, 3)] == [1.0, 1.0, 1.5]
    assert CPU_HOST.contention(9) == 1.5  # never more ranks than the node has
    assert A100.contention(8) == 1.0  # GPUs: each streams its own HBM


def test_cpu_host_decode_step_adds_up() -> None:
    """TPOT(1) on a CPU host, term by term (flops are negligible at these rates)."""
    workload = Workload(kv_cap_bytes=GIB // 4, avg_context=32)
    cm = CostModel(SMOLLM2, CPU_HOST, workload)
    hidden = 576 * 4
    layer = 576 * (576 + 2 * 192 + 576) * 4 + 3 * 576 * 1536 * 4 + 2 * 576 * 4  # q,k,v,o + mlp + norms
    kv = 2 * 192 * 4  # per layer per token
    lm_head = 49152 * 576 * 4

    tp1 = cm.stage_shapes(Candidate(1, 1, "float32"))[0]
    # The tied embedding is the lm_head: streamed once; the step does not read the table as an embedding.
    assert tp1.read_bytes == 30 * layer + 576 * 4 + lm_head == tp1.weight_bytes
    expected = (tp1.read_bytes + 32 * 30 * kv) / 10e9 + 30 * 200e-6 + 1e-3
    assert cm.tpot_s(Candidate(1, 1, "float32"), 1) == pytest.approx(expected)

    # TP3: three ranks busy at once (contention 1.5), 61 all-reduces and the logits' all-gather,
    # the step plan broadcast (size + payload).
    tp3 = cm.stage_shapes(Candidate(3, 1, "float32"))[0]
    link = Link("nvlink", 1e9, 100e-6)
    comm = 61 * ring_all_reduce_s(hidden, 3, link) + (2 / 3 * 49152 * 4 / 1e9 + 2 * 100e-6)
    expected = ((tp3.read_bytes + 32 * 30 * kv // 3) / (10e9 / 1.5) + comm + 1.5 * (30 * 200e-6 + 1e-3)
                + 2 * 300e-6)
    assert cm.tpot_s(Candidate(3, 1, "float32"), 1) == pytest.approx(expected)

    # PP2: one stage works at a time (no contention); stage 0 holds the embedding table but does
    # not stream it; the hidden state goes over once and the sampled token comes back (size +
    # payload) to the driver.
    s0, s1 = cm.stage_shapes(Candidate(1, 2, "float32"))
    assert s0.read_bytes == 15 * layer and s0.weight_bytes == 15 * layer + lm_head
    assert s1.read_bytes == s1.weight_bytes == 15 * layer + 576 * 4 + lm_head
    hop = 100e-6
    expected = ((s0.read_bytes + s1.read_bytes + 32 * 30 * kv) / 10e9 + 30 * 200e-6 + 1e-3 + 2 * 300e-6
                + (hop + hidden / 1e9) + 2 * (hop + 64 / 1e9))
    assert cm.tpot_s(Candidate(1, 2, "float32"), 1) == pytest.approx(expected)


def test_int8_plans_compute_at_the_topologys_int8_peak() -> None:
    """A calibrated CPU host measures its int8 matmul (the W8A8 kernel: int8 x int8 dot products),
    and an int8 plan's flops are priced at that rate; without the figure (a GPU, whose int8 plan
    converts its weights to 16 bits) at the 16-bit peak, as fp8's always are."""
    from dataclasses import replace

    slow = replace(CPU_HOST, peak_dense_flops=1e10)  # compute-bound at a batch of 64
    assert slow.peak_flops("int8") == slow.peak_dense_flops == slow.peak_flops("16bit")
    fast = replace(slow, peak_dense_flops_int8=4e10)
    assert fast.peak_flops("int8") == 4e10 and fast.peak_flops("16bit") == 1e10
    int8, fp8 = Candidate(1, 1, "int8"), Candidate(1, 1, "fp8")
    assert CostModel(SMOLLM2, fast).tpot_s(int8, 64) < CostModel(SMOLLM2, slow).tpot_s(int8, 64)
    assert CostModel(SMOLLM2, fast).tpot_s(fp8, 64) == CostModel(SMOLLM2, slow).tpot_s(fp8, 64)
    with pytest.raises(ValueError, match="peak_dense_flops_int8"):
        replace(CPU_HOST, peak_dense_flops_int8=0.0)
