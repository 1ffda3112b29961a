"""Everything one rank needs to run its shard: plan, groups, coordinator, loaded model."""

from __future__ import annotations

import hashlib
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.collective_events import EventSink, RingBufferSink
from services.common.numerics import DEFAULT_NUMERICS
from services.loader.layout import model_fingerprint
from services.loader.staging import stage_model_files
from services.loader.verify import read_manifest
from services.modeling.config import ModelConfig, ModelConfigError
from services.modeling.llama import LlamaForCausalLM
from services.modeling.parallel.coordinator import DEFAULT_TIMEOUT_S, Coordinator
from services.modeling.parallel.faults import WEIGHT_NOISE_ENV, NoisyCheckpoint, weight_noise_from_env
from services.modeling.parallel.groups import ParallelGroups, init_parallel_groups, resolve_device
from services.modeling.parallel.placement import node_id
from services.modeling.parallel.plan import ParallelPlan
from services.modeling.weights import CheckpointReader, load_weights
from services.worker.engine.kv_cache import CacheConfig
from services.worker.engine.scheduler import SchedulerConfig
from services.worker.rank_loading import load_checkpoint_weights, plan_for_checkpoint

# Loading takes different times on different ranks; the first meeting after it may wait that long.
LOAD_BARRIER_TIMEOUT_S = 600.0
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB per rank on CPU; GPUs default to the plan's 20 GiB


@dataclass(frozen=True)
class RankSpec:
    """What every rank of a replica group is asked to run (picklable: it crosses the process
    spawn): the layout to load, the KV cache each rank allocates, and the scheduler limits the
    driver applies. The parallel plan is resolved once, when the spec is made (reading
    config.json or the checkpoint's manifest), so a bad layout fails there and nothing re-reads
    it later."""

    model_dir: str | None
    tp_degree: int = field(default=1, kw_only=True)
    pp_degree: int = field(default=1, kw_only=True)
    dtype: str | None = field(default=None, kw_only=True)  # None: float32 from an HF directory, the checkpoint's
    activation_dtype: str | None = field(default=None, kw_only=True)  # int8/fp8 plans: None is bfloat16
    # int8/fp8 plans from an HF directory; None: the plan's default (services.modeling.parallel.plan)
    quantize_lm_head: bool | None = field(default=None, kw_only=True)
    numerics: str = field(default=DEFAULT_NUMERICS, kw_only=True)  # ParallelPlan's (services/common/numerics.py)
    replica_group_id: str = field(default="local", kw_only=True)
    collective_timeout_s: float = field(default=DEFAULT_TIMEOUT_S, kw_only=True)
    checkpoint: str | None = field(default=None, kw_only=True)  # manifest URI of a pre-sharded checkpoint
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(kv_cache_bytes=CPU_DEFAULT_KV_CACHE_BYTES),
                               kw_only=True)
    # the scheduler's batching limits (SchedulerConfig says what each means; its defaults)
    max_num_seqs: int = field(default=SchedulerConfig.max_num_seqs, kw_only=True)
    max_batched_tokens: int = field(default=SchedulerConfig.max_batched_tokens, kw_only=True)
    max_prefill_tokens_with_decodes: int = field(default=SchedulerConfig.max_prefill_tokens_with_decodes,
                                                 kw_only=True)
    max_model_len: int | None = field(default=None, kw_only=True)  # None: the model's max_position_embeddings
    # reuse the KV blocks of a prompt prefix computed before (the scheduler's prefix caching)
    prefix_caching: bool = field(default=True, kw_only=True)
    # "auto" (CUDA where torch sees a GPU), "cpu" or "cuda"; resolved to "cpu"/"cuda" when made
    device: str = field(default="auto", kw_only=True)
    # a single-GPU group replays its decode steps from CUDA graphs, one per batch size (False:
    # every step eagerly, vLLM's --enforce-eager); no effect on the CPU or across several ranks
    cuda_graphs: bool = field(default=True, kw_only=True)
    plan: ParallelPlan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device))
        if not self.model_dir and not self.checkpoint:
            raise ModelConfigError("give a model directory (--model) or a pre-sharded checkpoint (--checkpoint)")
        if self.checkpoint:
            plan = plan_for_checkpoint(self.checkpoint, tp_degree=self.tp_degree, pp_degree=self.pp_degree,
                                       dtype=self.dtype, activation_dtype=self.activation_dtype,
                                       numerics=self.numerics)
        else:
            plan = ParallelPlan(ModelConfig.from_dir(self.model_dir), self.tp_degree, self.pp_degree,
                                self.dtype or "float32", activation_dtype=self.activation_dtype,
                                quantize_lm_head=self.quantize_lm_head, numerics=self.numerics)
        object.__setattr__(self, "plan", plan)

    def scheduler_config(self) -> SchedulerConfig:
        max_position = self.plan.config.max_position_embeddings
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_batched_tokens=self.max_batched_tokens,
                               max_prefill_tokens_with_decodes=self.max_prefill_tokens_with_decodes,
                               max_model_len=min(self.max_model_len or max_position, max_position),
                               prefix_caching=self.prefix_caching)


def weights_fingerprint(spec: RankSpec) -> str:
    """Which weights a group of ``spec`` serves: the fingerprint of their source model
    (``model_fingerprint``), as a pre-sharded checkpoint's manifest records it or computed from the
    model directory, and a planted perturbation's spec with it (``SHARDLINE_WEIGHT_NOISE``: other
    weights). Two plans with the same fingerprint and dtype hold the same values, whatever their
    layout. Empty where the source cannot tell (no safetensors: a GGUF file)."""
    if spec.checkpoint:
        fingerprint = read_manifest(spec.checkpoint)[0].model_fingerprint
    else:
        try:
            fingerprint = model_fingerprint(spec.model_dir)
        except (OSError, ValueError, KeyError):
            return ""
    noise = os.environ.get(WEIGHT_NOISE_ENV)
    if noise:
        fingerprint = hashlib.sha256(f"{fingerprint}\0{WEIGHT_NOISE_ENV}={noise}".encode()).hexdigest()
    return fingerprint


def stage_tokenizer_dir(spec: RankSpec) -> str | None:
    """Where tokenizer.json lives: the model directory, else the checkpoint's verified model
    files (beside a local manifest, or downloaded from the object store into the stage cache)."""
    if spec.model_dir:
        return spec.model_dir
    if spec.checkpoint:
        staged = stage_model_files(spec.checkpoint)
        return str(staged) if staged is not None else None
    return None


@dataclass
class RankRuntime:
    plan: ParallelPlan
    groups: ParallelGroups
    coordinator: Coordinator
    model: LlamaForCausalLM
    loaded_bytes: int
    load_peak_rss_delta_bytes: int  # peak RSS while building + loading, minus the RSS before
    events: EventSink = field(repr=False, default_factory=RingBufferSink)
    node_ids: tuple[str, ...] = ()  # every global rank's node (placement.node_id), gathered at start

    @property
    def device(self) -> torch.device:
        return self.groups.device

    @classmethod
    def start(cls, spec: RankSpec, rank: int, *, sink: EventSink | None = None) -> RankRuntime:
        plan = spec.plan
        # the test hook is checked before anything starts: a bad spec fails this rank at once
        noise = weight_noise_from_env()
        if noise is not None:
            noise.check_layers(plan.config.num_hidden_layers)
            if spec.checkpoint:
                raise ModelConfigError(f"{WEIGHT_NOISE_ENV} perturbs weights loaded from a model directory, "
                                       f"before any quantization; this rank loads the pre-sharded checkpoint "
                                       f"{spec.checkpoint}")
        groups = init_parallel_groups(plan, rank=rank, device_type=spec.device)
        sink = sink if sink is not None else RingBufferSink()
        coordinator = Coordinator(groups, replica_group_id=spec.replica_group_id,
                                  timeout_s=spec.collective_timeout_s, sink=sink)
        rss_before = _current_rss_bytes()
        model = LlamaForCausalLM(plan, coordinator, device=groups.device)
        if spec.checkpoint:
            loaded = load_checkpoint_weights(
                model, plan, rank, spec.checkpoint,
                expected_fingerprint=model_fingerprint(spec.model_dir) if spec.model_dir else None)
        else:
            with CheckpointReader(Path(spec.model_dir)) as reader:
                source = reader if noise is None else NoisyCheckpoint(reader, noise, rank=rank)
                loaded = load_weights(model, source, tie_word_embeddings=plan.config.tie_word_embeddings)
        model.eval()
        peak_delta = _peak_rss_bytes() - rss_before
        coordinator.barrier(timeout_s=LOAD_BARRIER_TIMEOUT_S)
        nodes = [node_id()]
        if plan.world_size > 1:  # every rank's node, for the driver's registry rows
            nodes = [None] * plan.world_size
            dist.all_gather_object(nodes, node_id(), group=groups.control_group)
        return cls(plan, groups, coordinator, model, loaded, peak_delta, sink, tuple(nodes))


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _current_rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss_bytes() -> int:
    """This address space's high-water RSS. Not ``ru_maxrss``: Linux carries that over from the
    parent across fork+exec, so a spawned rank would report its launcher's peak."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
