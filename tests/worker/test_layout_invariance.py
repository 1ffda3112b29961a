"""The same bits at every pipeline layout: bfloat16 logprobs and tokens identical across PP degrees.

A pipeline stage runs its layers with the same kernels on the same shapes as the unsharded model
does, and hands the next stage its hidden states unchanged (a send of the exact tensor), so no
reduction's order depends on the number of stages: scoring (PP1, PP2, PP4) and generation (PP1,
PP2: a mixed batch of prompts decoding together, greedy, with logprobs) are bit-identical on the
tiny model in bfloat16. Tensor parallelism splits the row-parallel layers' sums by rank and is
not layout-invariant yet.
"""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams
from tests.worker.test_engine import generate, prompts_of
from tests.worker.test_parallel_parity import make_tiny, random_ids, sharded_logprobs

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
