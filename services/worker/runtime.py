"""Everything one rank needs to run its shard: plan, groups, coordinator, loaded model."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.collective_events import EventSink, RingBufferSink
from services.worker.models.config import ModelConfig
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.weights import CheckpointReader, load_weights
from services.worker.parallel.coordinator import DEFAULT_TIMEOUT_S, Coordinator
from services.worker.parallel.groups import ParallelGroups, init_parallel_groups
from services.worker.parallel.plan import ParallelPlan

# Loading takes different times on different ranks; the first meeting after it may wait that long.
LOAD_BARRIER_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankSpec:
    """What a rank is asked to run (picklable: it crosses the process spawn)."""

    model_dir: str
    tp_degree: int = 1
    pp_degree: int = 1
    dtype: str = "float32"
    replica_group_id: str = "local"
    collective_timeout_s: float = DEFAULT_TIMEOUT_S

    def plan(self) -> ParallelPlan:
        return ParallelPlan(ModelConfig.from_dir(self.model_dir), self.tp_degree, self.pp_degree, self.dtype)


@dataclass
class RankRuntime:
    plan: ParallelPlan
    groups: ParallelGroups
    coordinator: Coordinator
    model: LlamaForCausalLM
    loaded_bytes: int
    load_peak_rss_delta_bytes: int  # peak RSS while building + loading, minus the RSS before
    events: EventSink = field(repr=False, default_factory=RingBufferSink)

    @property
    def device(self) -> torch.device:
        return self.groups.device

    @classmethod
    def start(cls, spec: RankSpec, rank: int, *, sink: EventSink | None = None) -> RankRuntime:
        plan = spec.plan()
        groups = init_parallel_groups(plan, rank=rank)
        sink = sink if sink is not None else RingBufferSink()
        coordinator = Coordinator(groups, replica_group_id=spec.replica_group_id,
                                  timeout_s=spec.collective_timeout_s, sink=sink)
        rss_before = _current_rss_bytes()
        model = LlamaForCausalLM(plan, coordinator, device=groups.device)
        with CheckpointReader(Path(spec.model_dir)) as reader:
            loaded = load_weights(model, reader, tie_word_embeddings=plan.config.tie_word_embeddings)
        model.eval()
        peak_delta = _peak_rss_bytes() - rss_before
        coordinator.barrier(timeout_s=LOAD_BARRIER_TIMEOUT_S)
        return cls(plan, groups, coordinator, model, loaded, peak_delta, sink)


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
