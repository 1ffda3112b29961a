"""Fault injection for failure tests: make one rank die, hang or slow down at a chosen op.

Set ``SHARDLINE_FAULTS`` to one or more ``;``-separated specs, each ``key=value`` pairs joined
by ``,``:

    rank=1,op=all_reduce,after=5,action=kill      # SIGKILL rank 1 at its 6th all-reduce
    rank=0,op=recv,action=stop                    # SIGSTOP itself (a hung peer)
    rank=2,op=all_reduce,action=sleep:0.05        # a slow rank: sleep before every all-reduce
    rank=1,op=recv,after=3,times=1,action=sleep:1.5   # a link flap: one late recv (its peer's
                                                      # send waits 1.5 s), then all is well

``times`` caps how often a fault strikes (default: every match after ``after``). ``op=any``
matches every op. Only the coordinator consults this, so a fault can only strike
where a real failure would: at a collective.

Set ``SHARDLINE_WEIGHT_NOISE`` to perturb one decoder layer's weights as they load (a faulty or
stale shard, for the quality gate and the drift check to catch):

    layer=3,std=0.05                              # every linear weight of layer 3
    layer=1,std=0.5,seed=7,tensor=mlp.down_proj   # one tensor; ``+`` joins several

Each named tensor ``W`` becomes ``W + std * rms(W) * N(0, 1)``, the noise drawn for the full
checkpoint tensor from ``seed`` and the tensor's name. The loader's ``weight_loader`` then
slices (and, for an int8/fp8 plan, quantizes) the perturbed tensor as it would the clean one,
so every TP degree and every dtype holds the same perturbed weights.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from services.modeling.config import ModelConfigError

log = logging.getLogger(__name__)
WEIGHT_NOISE_ENV = "SHARDLINE_WEIGHT_NOISE"
# a decoder layer's linear weights, as the checkpoint names them (model.layers.N.<name>.weight)
LAYER_LINEAR_WEIGHTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass
class Fault:
    rank: int
    op: str = "any"
    after: int = 0
    action: str = "kill"
    times: int | None = None  # None: every match after ``after``
    seen: int = field(default=0, compare=False)

    def matches(self, rank: int, op: str) -> bool:
        return rank == self.rank and self.op in ("any", op)


def parse_faults(spec: str | None) -> list[Fault]:
    faults: list[Fault] = []
    for part in (spec or "").split(";"):
        part = part.strip()
        if not part:
            continue
        fields = dict(item.split("=", 1) for item in part.split(","))
        unknown = set(fields) - {"rank", "op", "after", "times", "action"}
        if unknown or "rank" not in fields:
            raise ValueError(f"bad SHARDLINE_FAULTS entry {part!r}: needs rank=, allows op=, after=, times=, "
                             f"action=")
        times = int(fields["times"]) if "times" in fields else None
        faults.append(Fault(rank=int(fields["rank"]), op=fields.get("op", "any"),
                            after=int(fields.get("after", 0)), action=fields.get("action", "kill"), times=times))
    return faults


class FaultInjector:
    def __init__(self, rank: int, spec: str | None = None) -> None:
        self.rank = rank
        self.faults = [f for f in parse_faults(spec if spec is not None else os.environ.get("SHARDLINE_FAULTS"))
                       if f.rank == rank]

    def __bool__(self) -> bool:
        return bool(self.faults)

    def before(self, op: str) -> None:
        for fault in self.faults:
            if not fault.matches(self.rank, op):
                continue
            fault.seen += 1
            if fault.seen <= fault.after:
                continue
            if fault.times is not None and fault.seen > fault.after + fault.times:
                continue
            if fault.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.action.startswith("sleep:"):
                time.sleep(float(fault.action.split(":", 1)[1]))
            else:
                raise ValueError(f"unknown fault action {fault.action!r}")


class WeightNoiseSpecError(ModelConfigError):
    """``SHARDLINE_WEIGHT_NOISE`` does not parse, or names a layer the model lacks (a bad
    configuration of the rank, reported as one)."""


@dataclass(frozen=True)
class WeightNoise:
    """Gaussian noise of relative size ``std`` (times each tensor's RMS) on ``tensors`` of decoder
    layer ``layer``."""

    layer: int
    std: float
    seed: int = 0
    tensors: tuple[str, ...] = LAYER_LINEAR_WEIGHTS

    def checkpoint_names(self) -> set[str]:
        return {f"model.layers.{self.layer}.{tensor}.weight" for tensor in self.tensors}

    def check_layers(self, num_hidden_layers: int) -> None:
        if self.layer >= num_hidden_layers:
            raise WeightNoiseSpecError(f"{WEIGHT_NOISE_ENV}: layer={self.layer}, but the model has "
                                       f"{num_hidden_layers} layers (0..{num_hidden_layers - 1})")

    def perturb(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (the full checkpoint tensor) plus this noise, in float32. The generator is
        seeded from ``seed`` and ``name`` only, so every rank draws the same full noise tensor."""
        clean = weight.to(torch.float32)
        rms = clean.pow(2).mean().sqrt()
        # CPU generators keep 32 bits of a seed: mix seed and name within them
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
        return clean + torch.randn(clean.shape, generator=generator, dtype=torch.float32) * (self.std * rms)


def parse_weight_noise(spec: str | None) -> WeightNoise | None:
    """``"layer=3,std=0.05[,seed=0][,tensor=mlp.down_proj]"`` -> :class:`WeightNoise`; empty: None."""
    if not (spec or "").strip():
        return None
    usage = (f"expected {WEIGHT_NOISE_ENV}='layer=N,std=X[,seed=S][,tensor=NAME[+NAME...]]' with NAME one of "
             f"{', '.join(LAYER_LINEAR_WEIGHTS)}")
    fields: dict[str, str] = {}
    for item in (part.strip() for part in spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("layer", "std", "seed", "tensor") or key.strip() in fields:
            raise WeightNoiseSpecError(f"bad {WEIGHT_NOISE_ENV} entry {item!r} in {spec!r}: {usage}")
        fields[key.strip()] = value.strip()
    if "layer" not in fields or "std" not in fields:
        raise WeightNoiseSpecError(f"{WEIGHT_NOISE_ENV}={spec!r} lacks layer= or std=: {usage}")
    try:
        layer, std, seed = int(fields["layer"]), float(fields["std"]), int(fields.get("seed", 0))
    except ValueError:
        raise WeightNoiseSpecError(f"{WEIGHT_NOISE_ENV}={spec!r}: layer and seed are whole numbers, std a "
                                   f"number") from None
    if layer < 0 or seed < 0 or not std > 0 or std == float("inf"):
        raise WeightNoiseSpecError(f"{WEIGHT_NOISE_ENV}={spec!r}: needs layer >= 0, seed >= 0 and a finite std > 0")
    tensors = tuple(fields["tensor"].split("+")) if "tensor" in fields else LAYER_LINEAR_WEIGHTS
    unknown = [t for t in tensors if t not in LAYER_LINEAR_WEIGHTS]
    if unknown:
        raise WeightNoiseSpecError(f"{WEIGHT_NOISE_ENV}={spec!r}: unknown tensor {unknown[0]!r}: {usage}")
    return WeightNoise(layer, std, seed, tensors)


def weight_noise_from_env() -> WeightNoise | None:
    return parse_weight_noise(os.environ.get(WEIGHT_NOISE_ENV))


class NoisyCheckpoint:
    """A checkpoint reader whose ``get_slice`` hands out the perturbed full tensor for the names
    ``noise`` targets (a ``weight_loader`` takes a tensor as well as a slice handle) and the
    reader's own slice handle for every other name. Only the targeted tensors are read whole."""

    def __init__(self, reader: Any, noise: WeightNoise, *, rank: int) -> None:
        self._reader = reader
        self.noise = noise
        self.model_dir = reader.model_dir
        self._targets = noise.checkpoint_names()
        self._rank = rank
        self._perturbed: dict[str, torch.Tensor] = {}

    def names(self) -> list[str]:
        return self._reader.names()

    def __contains__(self, name: str) -> bool:
        return name in self._reader

    def get_slice(self, name: str) -> Any:
        if name not in self._targets:
            return self._reader.get_slice(name)
        if name not in self._perturbed:  # a quantized layer asks twice: weight and scales
            clean = self._reader.get_slice(name)[:]
            self._perturbed[name] = self.noise.perturb(name, clean)
            log.warning("%s: rank %d perturbed %s %s with Gaussian noise of std %.4g x its RMS (seed %d)",
                        WEIGHT_NOISE_ENV, self._rank, name, list(clean.shape), self.noise.std, self.noise.seed)
        return self._perturbed[name]
