"""The fleet spec: the desired state of one fleet, in the ``shard-plan.yaml`` shape.

::

    replica_group:
      name: smollm2-primary          # the fleet's name; its groups are named <name>-<6 hex>
      tp_degree: 1
      pp_degree: 2
      dtype: bf16                    # any name or alias the project knows (bfloat16, int8, fp8, ...)
      kv_cache_cap_gb: 0.25          # KV cache per rank
      max_concurrent_sequences: 64
      collective_timeout_s: 2        # a collective slower than this fails the group (it is healed)
      prefix_caching: true           # reuse the KV blocks of cached prompt prefixes (the default)
      numerics: layout-invariant     # the default: the same bits at every TP (up to 8) and PP degree; or per-layout
      checkpoint:
        manifest_uri: s3://models/smollm2/bf16/manifest.json   # or model_dir: .models/smollm2-135m-instruct
      env: {}                        # extra environment of the group's processes
    replicas: 2                      # the group count without autoscaling
    rollout:
      max_surge: 1
      max_unavailable: 0
      drain_deadline_s: 30
      gate: {threshold_pct: 0.5, chunks: 8, chunk_tokens: 512}   # the golden set each candidate is scored on
    autoscaling:
      min_replicas: 1
      max_replicas: 3
      scale_on: kv_cache_utilization_pct
      scale_out_threshold: 80
      scale_in_threshold: 35
      window_s: 30
      cooldown_s: 60

Everything but ``replica_group.name`` and the checkpoint has a default. A spec is immutable;
:meth:`FleetSpec.plan_key` is what makes two revisions "the same plan" (a change in it is a
rollout, a change of only the replica count or autoscaling is not).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from services.common.dtypes import canonical_dtype
from services.common.errors import InvalidArgument
from services.common.numerics import DEFAULT_NUMERICS, NUMERICS
from services.quality.golden_set import DEFAULT_CHUNK_TOKENS

NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")  # a DNS label: it names Kubernetes objects
SCALE_ON = ("kv_cache_utilization_pct",)


class InvalidFleetSpec(InvalidArgument):
    """A fleet spec that cannot be applied; the message names the field."""


def _section(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, Mapping):
        raise InvalidFleetSpec(f"{where}{key} must be a mapping, got {type(value).__name__}")
    return dict(value)


def _take(section: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    value = section.pop(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind is not bool:
        raise InvalidFleetSpec(f"{where}{key} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise InvalidFleetSpec(f"{where}{key} must be {name}, got {value!r}")
    return value


def _no_extra(section: dict[str, Any], where: str) -> None:
    if section:
        raise InvalidFleetSpec(f"{where}: unknown field(s) {', '.join(sorted(section))}")


def _positive(value: float, name: str) -> None:
    if not value > 0:
        raise InvalidFleetSpec(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class GroupPlan:
    """What every replica group of a fleet is built from: its layout and its weights."""

    tp_degree: int = 1
    pp_degree: int = 1
    dtype: str = "bfloat16"
    kv_cache_cap_gb: float | None = None
    max_concurrent_sequences: int | None = None
    manifest_uri: str | None = None  # a verified sharded checkpoint (the loader stages it) ...
    model_dir: str | None = None  # ... or a model directory every group reads
    env: tuple[tuple[str, str], ...] = ()
    collective_timeout_s: float | None = None  # None: the worker's default
    prefix_caching: bool = True
    numerics: str = DEFAULT_NUMERICS  # ParallelPlan's (services/common/numerics.py)

    @property
    def world_size(self) -> int:
        return self.tp_degree * self.pp_degree

    @property
    def source(self) -> str:
        """Where the weights come from: the manifest URI, else the model directory."""
        return self.manifest_uri or self.model_dir or ""

    def describe(self) -> str:
        numerics = f" {self.numerics}" if self.numerics != DEFAULT_NUMERICS else ""
        return f"TP{self.tp_degree} x PP{self.pp_degree} {self.dtype}{numerics}"


@dataclass(frozen=True)
class RolloutPolicy:
    max_surge: int = 1
    max_unavailable: int = 0
    drain_deadline_s: float = 30.0
    gate_threshold_pct: float = 0.5
    gate_chunks: int = 8
    gate_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    gate_min_top1: float | None = None
    settle_s: float = 3.0  # after a group enters rotation, before an old one leaves: every router sees it


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int = 1
    max_replicas: int = 1
    scale_on: str = "kv_cache_utilization_pct"
    scale_out_threshold: float = 80.0
    scale_in_threshold: float = 35.0
    window_s: float = 30.0
    cooldown_s: float = 60.0


@dataclass(frozen=True)
class FleetSpec:
    name: str
    group: GroupPlan
    replicas: int = 1
    served_model_name: str | None = None
    rollout: RolloutPolicy = field(default_factory=RolloutPolicy)
    autoscaling: Autoscaling | None = None

    def plan_key(self) -> tuple[Any, ...]:
        """Two revisions with equal keys build interchangeable groups."""
        g = self.group
        return (g.tp_degree, g.pp_degree, g.dtype, g.kv_cache_cap_gb, g.max_concurrent_sequences, g.source, g.env,
                g.collective_timeout_s, g.prefix_caching, g.numerics, self.served_model_name)

    def bounded(self, replicas: int) -> int:
        """``replicas`` within the autoscaling bounds (the spec's count without autoscaling)."""
        if self.autoscaling is None:
            return self.replicas
        return max(self.autoscaling.min_replicas, min(self.autoscaling.max_replicas, replicas))

    def with_replicas(self, replicas: int) -> FleetSpec:
        return replace(self, replicas=replicas)

    # ---- the YAML/JSON form ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        g = self.group
        checkpoint = {"manifest_uri": g.manifest_uri} if g.manifest_uri else {"model_dir": g.model_dir}
        group: dict[str, Any] = {"name": self.name, "tp_degree": g.tp_degree, "pp_degree": g.pp_degree,
                                 "dtype": g.dtype, "checkpoint": checkpoint}
        if g.kv_cache_cap_gb is not None:
            group["kv_cache_cap_gb"] = g.kv_cache_cap_gb
        if g.max_concurrent_sequences is not None:
            group["max_concurrent_sequences"] = g.max_concurrent_sequences
        if g.collective_timeout_s is not None:
            group["collective_timeout_s"] = g.collective_timeout_s
        if not g.prefix_caching:
            group["prefix_caching"] = False
        if g.numerics != DEFAULT_NUMERICS:
            group["numerics"] = g.numerics
        if g.env:
            group["env"] = dict(g.env)
        r = self.rollout
        out: dict[str, Any] = {
            "replica_group": group, "replicas": self.replicas,
            "rollout": {"max_surge": r.max_surge, "max_unavailable": r.max_unavailable,
                        "drain_deadline_s": r.drain_deadline_s, "settle_s": r.settle_s,
                        "gate": {"threshold_pct": r.gate_threshold_pct, "chunks": r.gate_chunks,
                                 "chunk_tokens": r.gate_chunk_tokens,
                                 **({"min_top1_agreement": r.gate_min_top1} if r.gate_min_top1 is not None else {})}},
        }
        if self.served_model_name:
            out["served_model_name"] = self.served_model_name
        if self.autoscaling is not None:
            out["autoscaling"] = asdict(self.autoscaling)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base_dir: Path | None = None) -> FleetSpec:
        """Parse and check a spec; ``base_dir`` resolves a relative ``model_dir`` (the YAML's folder)."""
        if not isinstance(data, Mapping):
            raise InvalidFleetSpec(f"a fleet spec is a mapping, got {type(data).__name__}")
        top = dict(data)
        group = _section(top, "replica_group", "")
        top.pop("replica_group", None)
        name = _take(group, "name", str, "", "replica_group.")
        if not NAME_PATTERN.match(name):
            raise InvalidFleetSpec(f"replica_group.name must be a DNS label (lowercase letters, digits, '-', at most "
                                   f"40 characters), got {name!r}")
        plan = _group_plan(group, base_dir)
        replicas = _take(top, "replicas", int, 1, "")
        if replicas < 0:
            raise InvalidFleetSpec(f"replicas must be >= 0, got {replicas}")
        served = _take(top, "served_model_name", str, None, "")
        rollout = _rollout(_section(top, "rollout", ""))
        top.pop("rollout", None)
        autoscaling = _autoscaling(_section(top, "autoscaling", "")) if top.get("autoscaling") else None
        top.pop("autoscaling", None)
        _no_extra(top, "fleet spec")
        spec = cls(name, plan, replicas, served, rollout, autoscaling)
        return spec.with_replicas(spec.bounded(replicas))  # autoscaling bounds the starting count

    @classmethod
    def from_json(cls, text: str) -> FleetSpec:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: Path) -> FleetSpec:
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise InvalidFleetSpec(f"{path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise InvalidFleetSpec(f"{path}: not YAML: {exc}") from None
        return cls.from_dict(data, base_dir=path.parent)


def _group_plan(group: dict[str, Any], base_dir: Path | None) -> GroupPlan:
    w = "replica_group."
    tp = _take(group, "tp_degree", int, 1, w)
    pp = _take(group, "pp_degree", int, 1, w)
    if tp < 1 or pp < 1:
        raise InvalidFleetSpec(f"replica_group.tp_degree and pp_degree must be >= 1, got {tp} and {pp}")
    dtype_name = _take(group, "dtype", str, "bfloat16", w)
    try:
        dtype = canonical_dtype(dtype_name)
    except ValueError as exc:
        raise InvalidFleetSpec(f"replica_group.dtype: {exc}") from None
    kv = _take(group, "kv_cache_cap_gb", float, None, w)
    if kv is not None:
        _positive(kv, "replica_group.kv_cache_cap_gb")
    seqs = _take(group, "max_concurrent_sequences", int, None, w)
    if seqs is not None and seqs < 1:
        raise InvalidFleetSpec(f"replica_group.max_concurrent_sequences must be >= 1, got {seqs}")
    collective_timeout = _take(group, "collective_timeout_s", float, None, w)
    if collective_timeout is not None:
        _positive(collective_timeout, "replica_group.collective_timeout_s")
    prefix_caching = _take(group, "prefix_caching", bool, True, w)
    numerics = _take(group, "numerics", str, DEFAULT_NUMERICS, w)
    if numerics not in NUMERICS:
        raise InvalidFleetSpec(f"replica_group.numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    group.pop("gpus_per_replica", None)  # the seed's shape names it; it is tp x pp here
    group.pop("nvlink_domain", None)
    checkpoint = _section(group, "checkpoint", w)
    group.pop("checkpoint", None)
    manifest = _take(checkpoint, "manifest_uri", str, None, "replica_group.checkpoint.")
    model_dir = _take(checkpoint, "model_dir", str, None, "replica_group.checkpoint.")
    checkpoint.pop("shard_prefix", None)  # the manifest names its own files
    _no_extra(checkpoint, "replica_group.checkpoint")
    if (manifest is None) == (model_dir is None):
        raise InvalidFleetSpec("replica_group.checkpoint needs exactly one of manifest_uri and model_dir")
    if model_dir is not None:
        path = Path(model_dir).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        model_dir = str(path.resolve())
    env = _section(group, "env", w)
    group.pop("env", None)
    if not all(isinstance(k, str) and isinstance(v, str | int | float) for k, v in env.items()):
        raise InvalidFleetSpec("replica_group.env maps names to strings")
    _no_extra(group, "replica_group")
    return GroupPlan(tp, pp, dtype, kv, seqs, manifest, model_dir,
                     tuple(sorted((k, str(v)) for k, v in env.items())), collective_timeout, prefix_caching,
                     numerics)


def _rollout(section: dict[str, Any]) -> RolloutPolicy:
    w = "rollout."
    gate = _section(section, "gate", w)
    section.pop("gate", None)
    policy = RolloutPolicy(
        max_surge=_take(section, "max_surge", int, 1, w),
        max_unavailable=_take(section, "max_unavailable", int, 0, w),
        drain_deadline_s=_take(section, "drain_deadline_s", float, 30.0, w),
        settle_s=_take(section, "settle_s", float, 3.0, w),
        gate_threshold_pct=_take(gate, "threshold_pct", float, 0.5, "rollout.gate."),
        gate_chunks=_take(gate, "chunks", int, 8, "rollout.gate."),
        gate_chunk_tokens=_take(gate, "chunk_tokens", int, DEFAULT_CHUNK_TOKENS, "rollout.gate."),
        gate_min_top1=_take(gate, "min_top1_agreement", float, None, "rollout.gate."),
    )
    _no_extra(gate, "rollout.gate")
    _no_extra(section, "rollout")
    if policy.max_surge < 0 or policy.max_unavailable < 0 or policy.max_surge + policy.max_unavailable == 0:
        raise InvalidFleetSpec(f"rollout.max_surge and max_unavailable must be >= 0 and not both 0, got "
                               f"{policy.max_surge} and {policy.max_unavailable}")
    if policy.drain_deadline_s < 0 or policy.settle_s < 0:
        raise InvalidFleetSpec("rollout.drain_deadline_s and settle_s must be >= 0")
    if policy.gate_chunks < 1 or policy.gate_chunk_tokens < 2:
        raise InvalidFleetSpec(f"rollout.gate.chunks must be >= 1 and chunk_tokens >= 2, got {policy.gate_chunks} "
                               f"and {policy.gate_chunk_tokens}")
    _positive(policy.gate_threshold_pct, "rollout.gate.threshold_pct")
    return policy


def _autoscaling(section: dict[str, Any]) -> Autoscaling:
    w = "autoscaling."
    scaling = Autoscaling(
        min_replicas=_take(section, "min_replicas", int, 1, w),
        max_replicas=_take(section, "max_replicas", int, 1, w),
        scale_on=_take(section, "scale_on", str, SCALE_ON[0], w),
        scale_out_threshold=_take(section, "scale_out_threshold", float, 80.0, w),
        scale_in_threshold=_take(section, "scale_in_threshold", float, 35.0, w),
        window_s=_take(section, "window_s", float, 30.0, w),
        cooldown_s=_take(section, "cooldown_s", float, 60.0, w),
    )
    _no_extra(section, "autoscaling")
    if scaling.scale_on not in SCALE_ON:
        raise InvalidFleetSpec(f"autoscaling.scale_on must be one of {', '.join(SCALE_ON)}, got {scaling.scale_on!r}")
    if not 1 <= scaling.min_replicas <= scaling.max_replicas:
        raise InvalidFleetSpec(f"autoscaling needs 1 <= min_replicas <= max_replicas, got {scaling.min_replicas} "
                               f"and {scaling.max_replicas}")
    if not 0 <= scaling.scale_in_threshold < scaling.scale_out_threshold <= 100:
        raise InvalidFleetSpec(f"autoscaling needs 0 <= scale_in_threshold < scale_out_threshold <= 100, got "
                               f"{scaling.scale_in_threshold:g} and {scaling.scale_out_threshold:g}")
    if scaling.window_s < 0 or scaling.cooldown_s < 0:
        raise InvalidFleetSpec("autoscaling.window_s and cooldown_s must be >= 0")
    return scaling
