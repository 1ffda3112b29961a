"""The model, engine and sampler on a CUDA device (``gpu``: skipped without one; the lent GPU
machine runs them). The same checks run on the CPU through bench.gpu.check's quick mode."""

from __future__ import annotations

import pytest
import torch

from bench.gpu.correctness import Ours, check_dense, check_quantized, prompts_for
from services.common.sampling import SamplingParams
from services.worker.engine.bootstrap import generate_rank, start_rank
from services.worker.engine.kv_cache import CacheConfig
from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec
from tests.worker.oracle import reference_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_on_cuda_matches_transformers_there(tiny_model_dir, dtype):
    checks = check_dense("tiny", tiny_model_dir, dtype, "cuda", quick=True)
    assert all(c.passed for c in checks if c.required), checks


def test_tiny_quantized_on_cuda_stays_near_bfloat16(tiny_model_dir):
    checks = check_quantized("tiny", tiny_model_dir, "cuda")
    assert all(c.passed for c in checks), checks


def test_decode_steps_are_captured_and_replayed(tiny_model_dir):
    ours = Ours(tiny_model_dir, "float32", "cuda", graphs=True)
    prompts = prompts_for(512, (5, 30, 12))
    out = ours.generate(prompts, 16)
    graphs = ours.runner.graphs
    assert graphs.capture and graphs.replays == graphs.steps >= 15
    assert [batch for batch, _ in graphs.captured] == [4]  # three sequences, padded to the bucket of 4
    eager = Ours(tiny_model_dir, "float32", "cuda", graphs=False).generate(prompts, 16)
    assert [toks for toks, _ in out] == [toks for toks, _ in eager]


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_enforce_eager_turns_the_graphs_off(tiny_model_dir, cuda_graphs):
    spec = RankSpec(str(tiny_model_dir), device="cuda", cuda_graphs=cuda_graphs,
                    cache=CacheConfig(kv_cache_bytes=8 << 20))
    runner, _ = start_rank(spec, 0)
    assert runner.rt.device.type == "cuda" and (runner.graphs is not None) == cuda_graphs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP across GPUs needs two of them (NCCL: one GPU per rank)")
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tiny_across_two_gpus_equals_transformers(tiny_model_dir, tp, pp):
    spec = RankSpec(str(tiny_model_dir), tp_degree=tp, pp_degree=pp, device="cuda",
                    cache=CacheConfig(kv_cache_bytes=8 << 20))
    prompts = prompts_for(512, (7, 30))
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(prompts)
    outs = run_replica_group(tp * pp, generate_rank, spec, prompts, params)
    assert [o.token_ids for o in outs] == [reference_greedy(tiny_model_dir, p, 16) for p in prompts]
