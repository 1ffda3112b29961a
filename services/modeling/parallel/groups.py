"""Process groups of one replica group: the TP group of each stage, the PP group of each TP rank,
and a gloo control group for small control messages.

Global rank layout: ``global_rank = pp_stage * tp + tp_rank``. Every rank must create
every group in the same order (torch.distributed requirement), so all groups are built here.

The device a rank runs on is chosen here too (:func:`resolve_device`): ``cuda`` puts rank ``r`` of
a host on GPU ``LOCAL_RANK`` (one GPU per rank, NCCL between them), ``cpu`` keeps every rank on
the CPU (gloo). The control and result groups are gloo either way: they carry pickled plans.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.modeling.config import ModelConfigError
from services.modeling.parallel.plan import ParallelPlan


@dataclass
class ParallelGroups:
    """This rank's place in the replica group and the groups it belongs to."""

    tp_degree: int
    pp_degree: int
    global_rank: int
    backend: str
    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    control_group: dist.ProcessGroup | None
    # gloo group of the driver and the last stage's TP rank 0: sampled tokens come back on it,
    # so they never interleave with the plans broadcast on the control group
    result_group: dist.ProcessGroup | None = None
    device_type: str = "cpu"  # "cpu" or "cuda" (resolve_device)

    @property
    def world_size(self) -> int:
        return self.tp_degree * self.pp_degree

    @property
    def pp_stage(self) -> int:
        return self.global_rank // self.tp_degree

    @property
    def tp_rank(self) -> int:
        return self.global_rank % self.tp_degree

    @property
    def is_first_stage(self) -> bool:
        return self.pp_stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_stage == self.pp_degree - 1

    @property
    def is_driver(self) -> bool:
        return self.global_rank == 0

    def rank_of(self, pp_stage: int, tp_rank: int) -> int:
        return pp_stage * self.tp_degree + tp_rank

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.global_rank)) % torch.cuda.device_count())
        return torch.device("cpu")

    @classmethod
    def single(cls, device_type: str = "cpu") -> ParallelGroups:
        """TP=1, PP=1: no process group at all."""
        return cls(1, 1, 0, "none", None, None, None, None, device_type)

    @property
    def last_stage_leader(self) -> int:
        """Global rank of the last stage's TP rank 0: the rank that samples."""
        return self.rank_of(self.pp_degree - 1, 0)


DEVICES = ("auto", "cpu", "cuda")


class DeviceUnavailable(ModelConfigError):
    """A device was asked for that this machine or this build of torch does not have."""


def resolve_device(name: str | None) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``--device`` value: ``auto`` (or None) is CUDA where torch
    sees a GPU, else the CPU; ``cuda`` without one is refused, saying what torch sees."""
    name = name or "auto"
    if name not in DEVICES:
        raise DeviceUnavailable(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        build = torch.version.cuda or "none (a CPU build)"
        raise DeviceUnavailable(f"--device cuda, but torch {torch.__version__} sees no CUDA device "
                                f"(its CUDA: {build})")
    return name


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel_groups(plan: ParallelPlan, *, rank: int, device_type: str = "cpu",
                         init_timeout_s: float = 120.0) -> ParallelGroups:
    """Join the default process group (env:// rendezvous) and build TP, PP and control groups:
    NCCL for the data groups of ranks on GPUs, gloo on the CPU."""
    world = plan.world_size
    if world == 1:
        return ParallelGroups.single(device_type)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=init_timeout_s))
    tp, pp = plan.tp_degree, plan.pp_degree
    tp_group = pp_group = None
    for stage in range(pp):
        ranks = [stage * tp + r for r in range(tp)]
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            tp_group = group
    for tp_rank in range(tp):
        ranks = [s * tp + tp_rank for s in range(pp)]
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            pp_group = group
    control = dist.new_group(list(range(world)), backend="gloo")
    last_leader = (pp - 1) * tp
    result = dist.new_group([0, last_leader], backend="gloo") if last_leader != 0 else None
    return ParallelGroups(tp, pp, rank, backend, tp_group, pp_group, control,
                          result if rank in (0, last_leader) else None, device_type)
