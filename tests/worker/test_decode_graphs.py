"""The decode steps a GPU replays from CUDA graphs, run eagerly on the CPU from the same static
buffers: padded to batch and context buckets, dummy rows on the scratch block. The tokens and
log-probabilities are those of the plain engine, and no real block is touched by a padded row."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling import SamplingParams
from services.worker.engine.bootstrap import collect
from services.worker.engine.cuda_graphs import BATCH_BUCKETS, bucket_of, context_buckets
from services.worker.engine.engine import LLMEngine
from services.worker.engine.kv_cache import CacheConfig, KVCacheLayout
from services.worker.engine.runner import StageRunner
from services.worker.runtime import RankRuntime, RankSpec

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

MAX_BATCH = 16


def test_batches_and_contexts_round_up_to_their_buckets():
    assert [bucket_of(n, BATCH_BUCKETS) for n in (1, 3, 5, 8, 9, 17, 250)] == [1, 4, 8, 8, 16, 32, 256]
    assert context_buckets(1) == (1,) and context_buckets(12) == (1, 2, 4, 8, 12)
    assert [bucket_of(n, context_buckets(12)) for n in (1, 3, 9, 12)] == [1, 4, 12, 12]


def _run(model_dir, prompts, params, *, graphs: bool):
    spec = RankSpec(str(model_dir), cache=CacheConfig(kv_cache_bytes=8 << 20), max_num_seqs=MAX_BATCH, device="cpu")
    rt = RankRuntime.start(spec, 0)
    layout = KVCacheLayout.for_plan(rt.plan, spec.cache)
    runner = StageRunner(rt, layout, decode_graphs=graphs, max_batch=MAX_BATCH, max_model_len=256)
    engine = LLMEngine(runner, layout, tokenizer=None, scheduler_config=spec.scheduler_config())
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run_until_done()
    caches = [a.kv_cache for a in rt.model.attention_layers()]
    return [collect(h) for h in handles], runner, caches, layout


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_padded_static_decode_steps_match_the_plain_engine(tiny_model_dir, monkeypatch, kernels):
    if kernels == "reference":  # the PyTorch ops a GPU runs, with the static-width attention mask
        monkeypatch.setenv("SHARDLINE_CPU_KERNELS", "0")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 512, (n,), generator=gen).tolist() for n in (5, 40, 17, 3, 70)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 9, 17, 3, 30)]
    params[2] = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=17, ignore_eos=True, logprobs=2)
    plain, _, plain_caches, _ = _run(tiny_model_dir, prompts, params, graphs=False)
    padded, runner, caches, layout = _run(tiny_model_dir, prompts, params, graphs=True)

    graphs = runner.graphs
    assert graphs is not None and not graphs.capture and graphs.captured == []  # the CPU runs them eagerly
    assert graphs.steps >= 29  # every decode-only step: 5 sequences padded to 8, then fewer as they finish
    for a, b in zip(plain, padded, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # the real blocks hold the same keys and values; the padded rows wrote only the scratch block
    used = layout.num_blocks
    assert caches[0][0].shape[0] == used + 1 and plain_caches[0][0].shape[0] == used
    for (k, v), (pk, pv) in zip(caches, plain_caches, strict=True):
        torch.testing.assert_close(k[:used], pk, rtol=0, atol=1e-5)
        torch.testing.assert_close(v[:used], pv, rtol=0, atol=1e-5)
    assert caches[0][0][used].abs().sum() > 0  # the scratch block took the dummy rows' keys
