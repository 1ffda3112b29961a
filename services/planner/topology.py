"""The hardware a replica group runs on: nodes of GPUs, their memory, links and prices.

All fields are SI base units (bytes, bytes/s, seconds, FLOP/s) and the YAML file uses the same
names and units, so a topology file reads as what it is::

    name: a100-80g-8x
    gpus_per_node: 8
    gpu_memory_bytes: 85899345920
    intra_node_bandwidth_bytes_per_s: 6.0e+11
    intra_node_latency_s: 1.0e-06
    ...

``intra_node_*`` describes the NVLink/NVSwitch domain (bus bandwidth per GPU and per-hop
latency, the B and α of the ring all-reduce model); ``inter_node_*`` the network between nodes
(InfiniBand, or TCP). ``reserve_bytes`` is held back on every GPU for the CUDA context,
activations, NCCL buffers and allocator slack before weights and KV cache are placed.

The last four fields are costs of the serving stack and of a shared host, which only
`shardline plan calibrate` measures (the GPU presets leave them at 0 / unset, where they are small
next to the roofline):

* ``step_overhead_s``: the driver's fixed software cost per decode step (schedule, build the step,
  sample, stream the token), at batch 1;
* ``layer_overhead_s``: the fixed cost of one decoder layer on one rank beyond its weight reads
  (op dispatch on a CPU, kernel launches on a GPU);
* ``control_latency_s``: one small broadcast from the driver to every rank (the step plan);
* ``node_memory_bandwidth_bytes_per_s``: the bandwidth a node's ranks share. On a CPU host every
  rank streams weights from the same DRAM and runs on the same cores, so with k ranks busy at once
  each runs ``contention(k) = max(1, k · hbm_bandwidth / node_memory_bandwidth)`` times slower
  than alone (3 single-thread ranks on 2 cores: about 1.5). Unset: every GPU has its own HBM.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from services.common.errors import InvalidArgument

GIB = 1024**3
MIB = 1024**2


class TopologyError(InvalidArgument):
    """A topology is unknown, malformed, or physically inconsistent (a ValueError)."""


@dataclass(frozen=True)
class Topology:
    """One node type of the fleet and how its GPUs are connected."""

    name: str
    gpus_per_node: int
    gpu_memory_bytes: int
    nvlink_domain_size: int
    intra_node_bandwidth_bytes_per_s: float
    intra_node_latency_s: float
    inter_node_bandwidth_bytes_per_s: float
    inter_node_latency_s: float
    hbm_bandwidth_bytes_per_s: float
    peak_dense_flops: float  # 16-bit (bf16/fp16) dense matmul, per GPU
    peak_dense_flops_fp32: float
    usd_per_gpu_hour: float
    reserve_bytes: int = 3 * GIB
    device: str = "gpu"  # "gpu", or "cpu" for a calibrated CPU host whose "GPUs" are ranks
    step_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    control_latency_s: float = 0.0
    node_memory_bandwidth_bytes_per_s: float | None = None
    # int8 plans' matmuls (a CPU's W8A8 kernel); None: the 16-bit peak, as a GPU's int8 plan
    # converts its weights to 16 bits for each matmul
    peak_dense_flops_int8: float | None = None

    def __post_init__(self) -> None:
        positive_ints = ("gpus_per_node", "gpu_memory_bytes", "nvlink_domain_size")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise TopologyError(f"topology {self.name!r}: {name} must be a positive integer, got {value!r}")
        positive_floats = (
            "intra_node_bandwidth_bytes_per_s", "inter_node_bandwidth_bytes_per_s",
            "hbm_bandwidth_bytes_per_s", "peak_dense_flops", "peak_dense_flops_fp32",
        )
        for name in positive_floats:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise TopologyError(f"topology {self.name!r}: {name} must be a positive number, got {value!r}")
        for name in ("intra_node_latency_s", "inter_node_latency_s", "usd_per_gpu_hour", "step_overhead_s",
                     "layer_overhead_s", "control_latency_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise TopologyError(f"topology {self.name!r}: {name} must be ≥ 0, got {value!r}")
        if not isinstance(self.reserve_bytes, int) or self.reserve_bytes < 0:
            raise TopologyError(
                f"topology {self.name!r}: reserve_bytes must be a non-negative integer, got {self.reserve_bytes!r}"
            )
        if self.reserve_bytes >= self.gpu_memory_bytes:
            raise TopologyError(
                f"topology {self.name!r}: reserve_bytes {self.reserve_bytes} leaves nothing of "
                f"gpu_memory_bytes {self.gpu_memory_bytes}"
            )
        if self.nvlink_domain_size > self.gpus_per_node:
            # Multi-node NVLink (NVL72) is out of scope; a domain never spans nodes here.
            raise TopologyError(
                f"topology {self.name!r}: nvlink_domain_size {self.nvlink_domain_size} exceeds "
                f"gpus_per_node {self.gpus_per_node}"
            )
        for name in ("node_memory_bandwidth_bytes_per_s", "peak_dense_flops_int8"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
                raise TopologyError(f"topology {self.name!r}: {name} must be a positive number or unset, got {value!r}")
        if self.device not in ("gpu", "cpu"):
            raise TopologyError(f"topology {self.name!r}: device must be 'gpu' or 'cpu', got {self.device!r}")

    def peak_flops(self, compute: str) -> float:
        """Peak dense FLOP/s for a dtype's compute path ("16bit", "fp32" or "int8")."""
        if compute == "fp32":
            return self.peak_dense_flops_fp32
        if compute == "int8" and self.peak_dense_flops_int8 is not None:
            return self.peak_dense_flops_int8
        return self.peak_dense_flops

    def contention(self, active_ranks: int) -> float:
        """How many times slower each rank runs when ``active_ranks`` of one node work at once.

        ``max(1, k · hbm_bandwidth / node_memory_bandwidth)`` with k = min(active, gpus_per_node):
        the ranks of a CPU host share its DRAM bandwidth and cores, so past the host's capacity
        they split it. Always 1 for GPUs (no ``node_memory_bandwidth``): each streams its own HBM.
        """
        if self.node_memory_bandwidth_bytes_per_s is None or active_ranks <= 1:
            return 1.0
        k = min(active_ranks, self.gpus_per_node)
        return max(1.0, k * self.hbm_bandwidth_bytes_per_s / self.node_memory_bandwidth_bytes_per_s)

    def with_overrides(self, **overrides: Any) -> Topology:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        if "gpus_per_node" in changes and "nvlink_domain_size" not in changes:
            changes["nvlink_domain_size"] = min(self.nvlink_domain_size, changes["gpus_per_node"])
        if changes:
            changes.setdefault("name", f"{self.name}+custom")
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- YAML ----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "topology") -> Topology:
        if not isinstance(data, dict):
            raise TopologyError(f"{source}: expected a mapping of topology fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        # A calibrated file carries its raw measurements under `calibration`; the planner ignores them.
        body = {k: v for k, v in data.items() if k != "calibration"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise TopologyError(f"{source}: unknown field(s) {', '.join(unknown)}; expected {', '.join(sorted(known))}")
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = sorted(required - set(body))
        if missing:
            raise TopologyError(f"{source}: missing field(s) {', '.join(missing)}")
        values = dict(body)
        for name in ("gpus_per_node", "gpu_memory_bytes", "nvlink_domain_size", "reserve_bytes"):
            if name in values and isinstance(values[name], float) and values[name].is_integer():
                values[name] = int(values[name])
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text())
        except OSError as exc:
            raise TopologyError(f"cannot read topology file {p}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise TopologyError(f"{p} is not valid YAML: {exc}") from exc
        return cls.from_dict(data, source=str(p))

    def dump_yaml(self, *, calibration: dict[str, Any] | None = None) -> str:
        data: dict[str, Any] = self.to_dict()
        if calibration is not None:
            data["calibration"] = calibration
        return yaml.safe_dump(data, sort_keys=False)

    def save(self, path: str | Path, *, calibration: dict[str, Any] | None = None) -> None:
        Path(path).write_text(self.dump_yaml(calibration=calibration))


# Presets. Bandwidths are the figures engineers plan with: NVLink bus bandwidth per GPU and one
# InfiniBand NIC per GPU (HDR 200 Gb/s ≈ 25 GB/s on A100 nodes, NDR 400 Gb/s ≈ 50 GB/s on H100/H200).
# Per-hop latency: ~1 µs inside NVSwitch, ~5 µs across InfiniBand. Prices are on-demand-ish list
# prices per GPU-hour; override with --usd-per-gpu-hour.
def _hgx_8x(name: str, gpu_memory_bytes: int, nvlink_bandwidth: float, nic_bandwidth: float,
            hbm_bandwidth: float, flops_16bit: float, flops_fp32: float, usd_per_gpu_hour: float) -> Topology:
    """An 8-GPU node whose GPUs share one NVSwitch domain, with one InfiniBand NIC per GPU."""
    return Topology(
        name=name, gpus_per_node=8, gpu_memory_bytes=gpu_memory_bytes, nvlink_domain_size=8,
        intra_node_bandwidth_bytes_per_s=nvlink_bandwidth, intra_node_latency_s=1.0e-6,
        inter_node_bandwidth_bytes_per_s=nic_bandwidth, inter_node_latency_s=5.0e-6,
        hbm_bandwidth_bytes_per_s=hbm_bandwidth, peak_dense_flops=flops_16bit, peak_dense_flops_fp32=flops_fp32,
        usd_per_gpu_hour=usd_per_gpu_hour,
    )


PRESETS: dict[str, Topology] = {
    t.name: t
    for t in (
        # name, GPU memory, NVLink B/s, NIC B/s, HBM B/s, 16-bit FLOP/s, fp32 FLOP/s, $/GPU-hour
        _hgx_8x("a100-80g-8x", 80 * GIB, 600e9, 25e9, 2.039e12, 312e12, 19.5e12, 2.80),
        _hgx_8x("h100-80g-8x", 81559 * MIB, 900e9, 50e9, 3.35e12, 989e12, 67e12, 4.00),
        _hgx_8x("h200-141g-8x", 143771 * MIB, 900e9, 50e9, 4.8e12, 989e12, 67e12, 4.50),
    )
}


def load_topology(spec: str) -> Topology:
    """A preset name or a path to a topology YAML file."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.is_file():
        return Topology.load(path)
    raise TopologyError(f"unknown topology {spec!r}: expected a preset ({', '.join(PRESETS)}) or a YAML file")


__all__ = ["GIB", "MIB", "PRESETS", "Topology", "TopologyError", "load_topology"]
