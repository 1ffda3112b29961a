"""The same bits at every layout: bfloat16 logprobs and tokens identical across TP and PP degrees.

Pipeline stages run their layers with the same kernels on the same shapes as the unsharded model
does, and hand the next stage its hidden states unchanged (a send of the exact tensor), so no
reduction's order depends on the number of stages: scoring (PP1, PP2, PP4) and generation (PP1,
PP2: a mixed batch of prompts decoding together, greedy, with logprobs) are bit-identical on the
tiny model in bfloat16, in either numerics. Tensor parallelism splits a row-parallel layer's sum
by rank; in the layout-invariant numerics it is summed over fixed k-chunks in one fixed order
(services/modeling/parallel/layers.py), and TP1, TP2, TP4 and TP2 x PP2 give the same bits too.
"""

from __future__ import annotations

import pytest
import torch

from services.common.sampling import SamplingParams
from services.modeling.config import ModelConfig, ModelConfigError
from services.modeling.parallel.plan import ParallelPlan, invariant_chunks, invariant_tp_degrees, supported_tp_degrees
from services.worker.engine.bootstrap import generate_rank
from services.worker.engine.kv_cache import CacheConfig
from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec
from services.worker.scoring import score_rank
from tests.ranks import NUMERICS_COLLECTIVE_TIMEOUT_S
from tests.worker.oracle import reference_logprobs
from tests.worker.test_engine import generate, prompts_of
from tests.worker.test_parallel_parity import ENGLISH, make_tiny, random_ids, sharded_logprobs

PIPELINES = (1, 2, 4)  # the tiny model's 4 layers: 4, 2 + 2, 1 + 1 + 1 + 1 per stage


def test_scoring_is_bit_identical_at_every_pipeline_depth_in_bfloat16(tmp_path_factory):
    model_dir = make_tiny(tmp_path_factory.mktemp("tiny-bf16-pp"), "--dtype", "bfloat16")
    ids = random_ids(96, 512, seed=7)
    logprobs = {pp: sharded_logprobs(model_dir, ids, 1, pp, dtype="bfloat16")[0] for pp in PIPELINES}
    for pp in PIPELINES[1:]:
        assert torch.equal(logprobs[pp], logprobs[1]), (pp, (logprobs[pp] - logprobs[1]).abs().max().item())


def test_a_mixed_batch_generates_the_same_tokens_and_logprobs_at_every_pipeline_depth(tmp_path_factory):
    model_dir = make_tiny(tmp_path_factory.mktemp("tiny-bf16-gen"), "--dtype", "bfloat16")
    prompts = prompts_of([3, 40, 11, 90, 7, 25], seed=5)  # prefills and decodes share steps
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    # PP2 (two micro-batches in flight); PP4's four ranks on two cores would time the collectives out
    outs = {pp: generate(model_dir, prompts, params, pp=pp, dtype="bfloat16") for pp in (1, 2)}
    for pp in (2,):
        for a, b in zip(outs[1], outs[pp], strict=True):
            assert a.token_ids == b.token_ids, pp
            assert a.logprobs == b.logprobs, pp  # the floats themselves, not within a tolerance


# ---- tensor parallelism, layout-invariant numerics ----------------------------------------------

def test_plans_are_layout_invariant_by_default_up_to_tp8():
    """The default numerics; a 1B-class Llama (32 heads, 8 KV heads) also allows TP 16 and 32, which
    would cut its o_proj into 32 chunks of 64 columns: the family stops at TP 8 (8 chunks), and a
    plan above it must say per-layout."""
    config = ModelConfig.from_dict({"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                                    "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 49152})
    assert supported_tp_degrees(config) == [1, 2, 4, 8, 16, 32]
    assert invariant_tp_degrees(config) == [1, 2, 4, 8] and invariant_chunks(config) == 8
    assert ParallelPlan(config, 4, 1, "bfloat16").invariant_chunks == 8
    assert ParallelPlan(config, 16, 1, "bfloat16", numerics="per-layout").invariant_chunks == 0
    with pytest.raises(ModelConfigError, match="tp_degree=16 is beyond the layout-invariant numerics, which give "
                                               "this model the same bits at TP 1, 2, 4, 8: serve it with numerics "
                                               "per-layout"):
        ParallelPlan(config, 16, 1, "bfloat16")


INVARIANT = "layout-invariant"
TP_LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2)]


def invariant_spec(model_dir, tp: int, pp: int, dtype: str = "bfloat16") -> RankSpec:
    return RankSpec(str(model_dir), tp_degree=tp, pp_degree=pp, dtype=dtype, numerics=INVARIANT,
                    cache=CacheConfig(kv_cache_bytes=64 << 20), collective_timeout_s=NUMERICS_COLLECTIVE_TIMEOUT_S)


def test_scoring_is_bit_identical_at_every_tensor_parallel_degree_in_the_invariant_numerics(tmp_path_factory):
    model_dir = make_tiny(tmp_path_factory.mktemp("tiny-bf16-tp"), "--dtype", "bfloat16")
    ids = random_ids(96, 512, seed=8)
    logprobs = {}
    for tp, pp in TP_LAYOUTS:
        result = run_replica_group(tp * pp, score_rank, invariant_spec(model_dir, tp, pp), ids)
        logprobs[(tp, pp)] = torch.tensor(result.logprobs)
    base = logprobs[(1, 1)]
    for layout, got in logprobs.items():
        assert torch.equal(got, base), (layout, int((got != base).sum()), (got - base).abs().max().item())
    # still the model: as close to transformers' bfloat16 as the per-layout numerics
    assert (base - reference_logprobs(model_dir, ids, dtype="bfloat16")).abs().max().item() <= 5e-2


def test_an_odd_shape_scores_the_same_bits_at_tp3_and_pp3_in_the_invariant_numerics(tmp_path_factory):
    """Head dim 24, hidden 144 and intermediate 360 (each rank's k-chunks 48 and 120 wide: not
    whole 32-element vector chunks), vocabulary 519, three layers: TP3 and PP3 equal TP1."""
    model_dir = make_tiny(tmp_path_factory.mktemp("tiny-odd"), "--dtype", "bfloat16", "--layers", "3",
                          "--hidden", "144", "--heads", "6", "--kv-heads", "3", "--intermediate", "360",
                          "--vocab", "519")
    ids = random_ids(64, 519, seed=9)
    got = {(tp, pp): run_replica_group(tp * pp, score_rank, invariant_spec(model_dir, tp, pp), ids).logprobs
           for tp, pp in [(1, 1), (3, 1), (1, 3)]}
    assert got[(3, 1)] == got[(1, 1)] and got[(1, 3)] == got[(1, 1)]


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_plans_score_the_same_bits_at_tp1_and_tp2_in_the_invariant_numerics(tmp_path_factory, dtype):
    model_dir = make_tiny(tmp_path_factory.mktemp(f"tiny-{dtype}-tp"), "--dtype", "bfloat16")
    ids = random_ids(64, 512, seed=3)
    got = {tp: run_replica_group(tp, score_rank, invariant_spec(model_dir, tp, 1, dtype), ids).logprobs
           for tp in (1, 2)}
    assert got[1] == got[2]


@pytest.mark.slow
def test_smollm2_scores_the_same_bits_at_tp1_tp3_and_pp3_in_the_invariant_numerics(smollm2_dir):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(f"{smollm2_dir}/tokenizer.json").encode(ENGLISH).ids
    got = {(tp, pp): run_replica_group(tp * pp, score_rank, invariant_spec(smollm2_dir, tp, pp), ids).logprobs
           for tp, pp in [(1, 1), (3, 1), (1, 3)]}  # SmolLM2's 9 heads / 3 KV heads: no TP2
    assert got[(3, 1)] == got[(1, 1)] and got[(1, 3)] == got[(1, 1)]


def test_a_mixed_batch_generates_the_same_bits_at_every_layout_in_the_invariant_numerics(tmp_path_factory):
    model_dir = make_tiny(tmp_path_factory.mktemp("tiny-bf16-tp-gen"), "--dtype", "bfloat16")
    prompts = prompts_of([3, 40, 11, 90, 7, 25], seed=6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {(tp, pp): run_replica_group(tp * pp, generate_rank, invariant_spec(model_dir, tp, pp), prompts,
                                        [params] * 6)
            for tp, pp in TP_LAYOUTS}
    for layout, out in outs.items():
        for a, b in zip(outs[(1, 1)], out, strict=True):
            assert a.token_ids == b.token_ids, layout
            assert a.logprobs == b.logprobs, layout
