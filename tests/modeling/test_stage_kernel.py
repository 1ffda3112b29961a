"""The C++ stage kernel (``decoder_layers``) against the Python loop over the same layers: the
same kernels in the same order, so a served request's tokens and logprobs have the same bits."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling import SamplingParams
from services.modeling.kernels import cpu_kernels, pack_dense
from services.modeling.tiny import TinyModelSpec, write_tiny_model
from services.worker.engine.bootstrap import build_engine, start_rank
from services.worker.engine.engine import FinishEvent
from services.worker.engine.kv_cache import CacheConfig
from services.worker.engine.step import TokenEvent
from services.worker.runtime import RankSpec

pytestmark = [pytest.mark.skipif(cpu_kernels() is None, reason="no C++ toolchain here: the CPU kernels did not build"),
              pytest.mark.background]  # in this process alone: the lane may run it at idle priority


def served(engine, prompts: list[list[int]], max_tokens: int) -> list[list[tuple[int, float]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    handles = [engine.submit(p, params) for p in prompts]
    engine.run_until_done()
    out = []
    for handle in handles:
        events = []
        while not handle.events.empty():
            events.append(handle.events.get_nowait())
        assert isinstance(events[-1], FinishEvent), events[-1]
        out.append([(e.token_id, e.logprob, tuple(e.top_logprobs)) for e in events if isinstance(e, TokenEvent)])
    return out


# the layout-invariant numerics: the row-parallel layers' fixed k-chunks summed in the call too
@pytest.mark.parametrize("dtype,numerics", [("bfloat16", "per-layout"), ("float32", "per-layout"),
                                            ("int8", "per-layout"), ("bfloat16", "layout-invariant"),
                                            ("float32", "layout-invariant"), ("int8", "layout-invariant"),
                                            ("fp8", "layout-invariant")])
def test_the_stage_kernel_serves_the_bits_of_the_python_loop(tiny_model_dir, dtype, numerics):
    # prompts split over prefill chunks, mixed with decodes; no prefix caching, so that the second
    # pass computes every prompt again, in the same steps as the first
    spec = RankSpec(str(tiny_model_dir), dtype=dtype, cache=CacheConfig(kv_cache_bytes=16 << 20),
                    max_batched_tokens=48, prefix_caching=False, numerics=numerics)
    runner, layout = start_rank(spec, 0)
    engine = build_engine(spec, runner, layout)
    model = runner.rt.model.model
    assert model.fused_layers  # TP = 1
    assert bool(model.invariant_chunks) == (numerics == "layout-invariant")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (5, 70, 19, 33)]
    try:
        fused = served(engine, prompts, 12)
        model.fused_layers = False
        loop = served(engine, prompts, 12)
    finally:
        engine.shutdown()
    assert all(len(tokens) == 12 for tokens in fused)
    assert fused == loop


def test_a_served_model_packs_its_weights_and_its_tied_table_still_embeds(tmp_path):
    """A bfloat16 engine on a tiny model with a tied lm_head, where weights pack (the kernel:
    test_gemm_packed.py): after the first step every linear weight and the shared table are
    packed, a lookup reads the same rows as before, and a prompt served again (now alone, then in
    a batch) gets the same tokens and logprobs."""
    probe = torch.ones(16, 2, dtype=torch.bfloat16)
    if pack_dense(probe) is probe:
        pytest.skip("this machine keeps dense weights as [N, K]: it has AMX tiles, or neither AVX512-BF16 nor "
                    "AVX2 + FMA")
    write_tiny_model(TinyModelSpec(tie_embeddings=True), tmp_path)
    spec = RankSpec(str(tmp_path), dtype="bfloat16", cache=CacheConfig(kv_cache_bytes=16 << 20))
    runner, layout = start_rank(spec, 0)
    engine = build_engine(spec, runner, layout)
    model = runner.rt.model
    ids = torch.tensor([3, 77, 500, 3])
    table = model.model.embed_tokens(ids).clone()

    try:
        prompt = [5, 9, 200, 31, 7]
        first = served(engine, [prompt], 6)[0]
        layer = next(iter(model.model.layers.values()))
        assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dim() == 4
        assert all(p.dim() == 4 for p in (layer.self_attn.qkv_proj.weight, layer.mlp.down_proj.weight))
        assert torch.equal(model.model.embed_tokens(ids), table)
        assert served(engine, [prompt], 6)[0] == first
        assert served(engine, [[8, 8, 8], prompt, list(range(40, 90))], 6)[1] == first
    finally:
        engine.shutdown()
