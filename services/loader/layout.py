"""What one rank holds, derived from the model itself; and the fingerprint of a source checkpoint.

The rank's tensors (names, shapes, dtypes) are read off :class:`LlamaForCausalLM` built for that
rank on the ``meta`` device — no memory, no process group — so the writer, the verifier and the
loader all take the layout from the one place that defines it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from services.loader.errors import ShardLayoutError
from services.loader.manifest import TensorInfo
from services.loader.safetensors_format import ITEMSIZE, canonical_dtype_of, read_header
from services.modeling.llama import LlamaForCausalLM
from services.modeling.parallel.coordinator import Coordinator
from services.modeling.parallel.groups import ParallelGroups
from services.modeling.parallel.plan import ParallelPlan

# Bytes of each tensor's data folded into the fingerprint (see model_fingerprint).
FINGERPRINT_SAMPLE_BYTES = 64 * 1024


def rank_model(plan: ParallelPlan, global_rank: int, *, device: str = "meta") -> LlamaForCausalLM:
    """Rank ``global_rank``'s stage of the model, built without a process group.

    No collective runs at construction, so a group-less coordinator is enough to learn the
    rank's parameter names and shapes (on ``meta``) or to hold weights for a comparison.
    """
    if not 0 <= global_rank < plan.world_size:
        raise ShardLayoutError(f"rank {global_rank} is outside the plan's {plan.world_size} ranks")
    groups = ParallelGroups(plan.tp_degree, plan.pp_degree, global_rank, "none", None, None, None)
    return LlamaForCausalLM(plan, Coordinator(groups), device=device)


def unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters in registration order, each once: a tied lm_head (PP=1) shares the embedding's
    tensor and appears only under ``model.embed_tokens.weight``."""
    return list(model.named_parameters())


@dataclass(frozen=True)
class RankLayout:
    """What rank (tp_rank, pp_stage) of a plan holds: its layer range and every tensor."""

    tp_rank: int
    pp_stage: int
    layer_start: int
    layer_end: int
    dtype: str
    tensors: dict[str, TensorInfo]

    def __post_init__(self) -> None:
        if self.layer_end <= self.layer_start:
            raise ShardLayoutError(f"empty layer range [{self.layer_start}, {self.layer_end})")

    @classmethod
    def of_model(cls, model: LlamaForCausalLM, plan: ParallelPlan, global_rank: int) -> RankLayout:
        pp_stage, tp_rank = plan.coords(global_rank)
        layers = plan.stage_layers(pp_stage)
        tensors = {name: TensorInfo(tuple(p.shape), canonical_dtype_of(p.dtype)) for name, p in unique_parameters(model)}
        return cls(tp_rank, pp_stage, layers.start, layers.stop, plan.dtype, tensors)

    @classmethod
    def for_rank(cls, plan: ParallelPlan, global_rank: int) -> RankLayout:
        return cls.of_model(rank_model(plan, global_rank), plan, global_rank)

    @property
    def nbytes(self) -> int:
        total = 0
        for info in self.tensors.values():
            numel = 1
            for d in info.shape:
                numel *= d
            total += numel * ITEMSIZE[info.dtype]
        return total


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of an HF directory (index order, else the single file)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json found")
    return [single]


def canonical_config_bytes(config: dict) -> bytes:
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 identifying a source checkpoint: its canonical config.json, every tensor's name,
    shape and dtype, and the first :data:`FINGERPRINT_SAMPLE_BYTES` of every tensor's data.

    It tells two models apart (a different shape, dtype or seed changes it) at the cost of a few
    MB of reads; it is not an integrity check — each shard's sha256 in the manifest is.
    """
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    digest.update(b"config\0" + canonical_config_bytes(json.loads((model_dir / "config.json").read_text())))
    entries: list[tuple[str, str, tuple[int, ...], bytes]] = []
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = read_header(f, file_bytes=size)
            for t in header.tensors:
                f.seek(header.data_start + t.begin)
                entries.append((t.name, t.dtype, t.shape, f.read(min(t.nbytes, FINGERPRINT_SAMPLE_BYTES))))
    for name, dtype, shape, sample in sorted(entries):
        digest.update(f"\0{name}\0{dtype}\0{list(shape)}\0".encode())
        digest.update(hashlib.sha256(sample).digest())
    return digest.hexdigest()
