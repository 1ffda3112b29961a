"""Prefix caching across a replica group's ranks: a prompt whose leading blocks another request
computed before reuses them, and gets the tokens and logprobs it would get without the cache (at
TP1, TP2 and PP2; in bfloat16 the same bits, the kernels being batch-invariant), also when
sequences are preempted and cached blocks evicted under KV pressure."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common.sampling import SamplingParams
from services.modeling.kernels import dense_linear_vectorized
from services.worker.engine.bootstrap import Completion, build_engine, collect, start_rank
from services.worker.engine.kv_cache import CacheConfig
from services.worker.engine.runner import follower_loop
from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec
from tests.ranks import NUMERICS_COLLECTIVE_TIMEOUT_S
from tests.worker.test_engine import prompts_of

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)


@dataclass
class Phases:
    """What a group returned: each phase's completions, and its scheduler's counters."""

    completions: list[list[Completion]]
    queries: int
    hits: int
    evictions: int
    preemptions: int


def phases_rank(rank: int, world_size: int, spec: RankSpec,
                phases: list[list[tuple[list[int], SamplingParams]]]) -> Phases | None:
    """Rank entry point: each phase's requests run to completion before the next is submitted."""
    runner, layout = start_rank(spec, rank)
    if rank != 0:
        follower_loop(runner)
        return None
    engine = build_engine(spec, runner, layout)
    done, preemptions = [], 0
    for phase in phases:
        handles = [engine.submit(ids, params) for ids, params in phase]
        engine.run_until_done()
        done.append([collect(handle) for handle in handles])
        preemptions += sum(handle.seq.num_preemptions for handle in handles)
    engine.shutdown()
    s = engine.scheduler
    return Phases(done, s.prefix_cache_queries, s.prefix_cache_hits, s.allocator.num_evictions, preemptions)


def run(model_dir, phases, *, tp=1, pp=1, dtype=None, caching=True, cache=None, max_batched_tokens=2048) -> Phases:
    spec = RankSpec(str(model_dir), tp_degree=tp, pp_degree=pp, dtype=dtype, prefix_caching=caching,
                    cache=cache or CacheConfig(block_size=16, kv_cache_bytes=64 << 20),
                    max_batched_tokens=max_batched_tokens, collective_timeout_s=NUMERICS_COLLECTIVE_TIMEOUT_S)
    return run_replica_group(tp * pp, phases_rank, spec, phases)


def assert_same(cached: list[Completion], uncached: list[Completion], dtype: str) -> None:
    for a, b in zip(cached, uncached, strict=True):
        assert a.token_ids == b.token_ids
        if dtype == "bfloat16":  # batch-invariant kernels: the same bits
            assert a.logprobs == b.logprobs
        else:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6, rel=0)


@pytest.mark.parametrize(("tp", "pp", "dtype"), [(1, 1, "bfloat16"), (2, 1, "float32"), (1, 2, "bfloat16")])
def test_prefix_hits_change_no_output(tiny_model_dir, tp, pp, dtype):
    """A 70-token prefix (4 full blocks of 16) computed by a first request; then requests that
    share 1 block of it, all 4, the whole first prompt (which the cache holds but for its last
    token) and none, greedy with logprobs and seeded; each equals the same request run on a group
    without prefix caching."""
    if dtype == "bfloat16" and not dense_linear_vectorized():
        pytest.skip("neither AVX512-BF16 nor AVX2 here: the dense matmuls are F.linear, not batch-invariant")
    prefix, a, b, c, other = prompts_of([70, 9, 5, 20, 30], seed=11)
    first = [(prefix + a, GREEDY)]
    second = [(prefix[:20] + b, GREEDY), (prefix + c, GREEDY), (prefix + a, GREEDY), (prefix + c, SEEDED),
              (other, GREEDY)]
    cached = run(tiny_model_dir, [first, second], tp=tp, pp=pp, dtype=dtype)
    uncached = run(tiny_model_dir, [second], tp=tp, pp=pp, dtype=dtype, caching=False)
    assert_same(cached.completions[1], uncached.completions[0], dtype)
    # hits: 1 block; 4 for prefix + c; 4 for the first prompt again (79 tokens: block 5 is partial);
    # 5 for the seeded prefix + c, admitted in the same step as its greedy twin, whose chunk writes
    # those blocks before the step's attention reads them
    assert cached.hits == 16 * (1 + 4 + 4 + 5)
    assert cached.queries == 79 + 25 + 90 + 79 + 90 + 30
    assert uncached.hits == uncached.queries == 0


def test_preemption_and_eviction_under_kv_pressure_change_no_output(tiny_model_dir):
    """16 requests over 4 shared prefixes in a cache of 24 blocks of 4 tokens, 32-token steps:
    sequences are preempted and cached blocks evicted, and each output equals the uncached run."""
    prefixes = prompts_of([12, 17, 8, 21], seed=5)
    suffixes = prompts_of([3 + i % 5 for i in range(16)], seed=6)
    requests = [(prefixes[i % 4] + suffixes[i], GREEDY if i % 3 else SEEDED) for i in range(16)]
    cache = CacheConfig(block_size=4, num_blocks=24)
    cached = run(tiny_model_dir, [requests[:4], requests[4:]], cache=cache, max_batched_tokens=32)
    uncached = run(tiny_model_dir, [requests[:4], requests[4:]], cache=cache, max_batched_tokens=32, caching=False)
    for got, want in zip(cached.completions, uncached.completions, strict=True):
        assert_same(got, want, "float32")
    assert cached.hits > 0 and cached.evictions > 0 and cached.preemptions > 0
