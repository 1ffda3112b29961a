"""The device check's measuring half: decode steps of Llama-3-shaped models with random weights
made on the device (no checkpoint: the 70B shape in fp8 is ~70 GB), against the memory roofline.

For each (shape, dtype) the model is built on the device and filled with random values of the
right scale (normal(0, 0.02) weights; quantized plans get random int8 / e4m3 values and scales
that give the same spread). One engine then serves each batch size in turn: ``batch``
requests of a random ``prompt_len``-token prompt, one prefill step, then decode steps timed one
by one (each ends when its sampled tokens are on the host). A few warm-up steps first (a new
batch size captures its CUDA graph there); the prompt length keeps every timed step in one
context bucket, so no capture falls inside the timing.

- TPOT: the median decode step; tokens/s: batch / TPOT;
- roofline: the bytes a decode step must read (every linear weight and the lm_head; of the
  embedding only the looked-up rows, so it is left out) over the device's copy bandwidth
  measured in the same run (``dst.copy_(src)`` of a buffer far larger than the caches, read +
  write bytes over time); ``step/roofline`` = TPOT / roofline time.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from bench.engine import weight_bytes
from services.common.sampling import SamplingParams
from services.modeling.config import ModelConfig
from services.modeling.llama import LlamaForCausalLM
from services.modeling.parallel.coordinator import Coordinator
from services.modeling.parallel.groups import ParallelGroups
from services.modeling.parallel.plan import ParallelPlan
from services.planner.specs import PRESETS, ModelSpec
from services.worker.engine.engine import LLMEngine
from services.worker.engine.kv_cache import CacheConfig, KVCacheLayout
from services.worker.engine.runner import StageRunner
from services.worker.engine.scheduler import SchedulerConfig
from services.worker.runtime import RankRuntime

WEIGHT_STD = 0.02
# typical |value| of the random quantized values below, so that scale · value has WEIGHT_STD
QUANT_SPREAD = {torch.int8: 127 / 3 ** 0.5, torch.float8_e4m3fn: 64.0}
FILL_CHUNK = 1 << 26  # elements per random draw: a few hundred MB of float32 at most
BLOCK_SIZE = 16


@dataclass
class DecodeRow:
    shape: str
    dtype: str
    batch: int
    tpot_ms: float
    tokens_per_s: float
    weight_gb: float
    roofline_ms: float
    step_over_roofline: float
    graphs: bool
    steps: int

    def as_dict(self) -> dict:
        return asdict(self)


def model_config(spec: ModelSpec, *, max_position: int = 8192) -> ModelConfig:
    """A planner preset's shape as the model's config (Llama 3's rope theta)."""
    return ModelConfig(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                       num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
                       num_key_value_heads=spec.num_key_value_heads, vocab_size=spec.vocab_size,
                       head_dim=spec.head_dim, rope_theta=500000.0, max_position_embeddings=max_position,
                       tie_word_embeddings=spec.tie_word_embeddings, name=spec.name)


def shape_config(name: str) -> ModelConfig:
    return model_config(PRESETS[name])


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second moved by ``dst.copy_(src)`` over ``nbytes`` (read + write counted), the
    median of five after a warm-up."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(6):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


@torch.no_grad()
def random_model(cfg: ModelConfig, dtype: str, device: str) -> RankRuntime:
    """One rank holding the whole model on ``device``, every parameter filled at random."""
    plan = ParallelPlan(cfg, 1, 1, dtype)
    groups = ParallelGroups.single(device)
    coordinator = Coordinator(groups, replica_group_id=f"gpu-check-{cfg.name}-{dtype}")
    model = LlamaForCausalLM(plan, coordinator, device=torch.device(device))
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith("weight_scale"):
            p.fill_(WEIGHT_STD / QUANT_SPREAD[_quantized_dtype(model, name)])
        elif p.dim() == 1:  # RMSNorm gains
            p.fill_(1.0)
        elif p.dtype == torch.int8:
            p.random_(-127, 128, generator=gen)
        else:  # dense weights, and e4m3 values drawn in float32 and rounded
            scale = QUANT_SPREAD[p.dtype] if p.dtype == torch.float8_e4m3fn else WEIGHT_STD
            flat = p.view(-1)
            for start in range(0, flat.numel(), FILL_CHUNK):
                part = flat[start:start + FILL_CHUNK]
                part.copy_(torch.randn(part.shape, generator=gen, device=device).mul_(scale).clamp_(-448, 448))
    model.eval()
    return RankRuntime(plan, groups, coordinator, model, loaded_bytes=0, load_peak_rss_delta_bytes=0)


def _quantized_dtype(model: torch.nn.Module, scale_name: str) -> torch.dtype:
    return model.get_parameter(scale_name.removesuffix("_scale")).dtype


def measure(shape: str, cfg: ModelConfig, dtype: str, device: str, *, batches: tuple[int, ...], prompt_len: int,
            steps: int, warmup: int, bandwidth: float, graphs: bool = True) -> list[DecodeRow]:
    rt = random_model(cfg, dtype, device)
    max_batch, max_len = max(batches), prompt_len + warmup + steps + 1
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    layout = KVCacheLayout.for_plan(rt.plan, CacheConfig(block_size=BLOCK_SIZE, num_blocks=max_batch * blocks_per_seq))
    runner = StageRunner(rt, layout, decode_graphs=graphs, max_batch=max_batch, max_model_len=max_len)
    engine = LLMEngine(runner, layout, tokenizer=None, scheduler_config=SchedulerConfig(
        max_num_seqs=max_batch, max_batched_tokens=max_batch * prompt_len, max_model_len=max_len))
    nbytes = weight_bytes(rt.model)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in batches:
        params = SamplingParams(temperature=0, max_tokens=warmup + steps + 1, ignore_eos=True)
        for _ in range(batch):
            engine.submit(torch.randint(4, cfg.vocab_size, (prompt_len,), generator=gen).tolist(), params)
        engine.step()  # every prompt in one prefill step
        times = []
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            engine.step()  # ends once the sampled tokens are on the host
            times.append(time.perf_counter() - t0)
        engine.run_until_done()
        tpot = statistics.median(times[warmup:])
        roofline = nbytes / bandwidth
        rows.append(DecodeRow(shape, dtype, batch, tpot * 1e3, batch / tpot, nbytes / 1e9, roofline * 1e3,
                              tpot / roofline, graphs and device == "cuda", steps))
    del engine, runner, rt
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
