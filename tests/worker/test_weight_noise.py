"""The SHARDLINE_WEIGHT_NOISE test hook: one layer's weights perturbed by a known relative amount,
the same perturbed tensor at every TP degree, and a bad spec refused before a rank loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.config import child_environ
from services.modeling.parallel.faults import (
    LAYER_LINEAR_WEIGHTS,
    WeightNoise,
    WeightNoiseSpecError,
    parse_weight_noise,
)

REPO = Path(__file__).resolve().parents[2]
IDS = ",".join(str((7 * i + 3) % 500) for i in range(40))


def test_specs_parse_and_bad_ones_name_the_problem() -> None:
    assert parse_weight_noise(None) is None and parse_weight_noise(" ") is None
    assert parse_weight_noise("layer=3,std=0.05") == WeightNoise(3, 0.05, 0, LAYER_LINEAR_WEIGHTS)
    assert parse_weight_noise("layer=1, std=0.5, seed=7, tensor=mlp.down_proj+self_attn.o_proj") == WeightNoise(
        1, 0.5, 7, ("mlp.down_proj", "self_attn.o_proj"))
    for bad, says in (("layer=1", "lacks layer= or std="), ("std=0.1", "lacks"), ("layer=1,std=0.1,sd=2", "'sd=2'"),
                      ("layer=x,std=0.1", "whole numbers"), ("layer=1,std=0", "std > 0"),
                      ("layer=-1,std=0.1", "layer >= 0"), ("layer=1,std=0.1,tensor=mlp.fc", "'mlp.fc'"),
                      ("layer=1,std=0.1,layer=2", "'layer=2'")):
        with pytest.raises(WeightNoiseSpecError, match="SHARDLINE_WEIGHT_NOISE") as err:
            parse_weight_noise(bad)
        assert says in str(err.value), (bad, str(err.value))
    with pytest.raises(WeightNoiseSpecError, match="layer=4, but the model has 4 layers"):
        WeightNoise(4, 0.1).check_layers(4)


def test_noise_is_relative_to_the_tensor_and_fixed_by_seed_and_name() -> None:
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    noise = WeightNoise(1, 0.1)
    name = "model.layers.1.mlp.down_proj.weight"
    noisy = noise.perturb(name, weight)
    rms = weight.pow(2).mean().sqrt()
    assert (noisy - weight).pow(2).mean().sqrt() / rms == pytest.approx(0.1, rel=0.02)
    assert torch.equal(noisy, noise.perturb(name, weight.clone()))
    assert not torch.equal(noisy, noise.perturb("model.layers.1.mlp.up_proj.weight", weight))
    assert not torch.equal(noisy, WeightNoise(1, 0.1, seed=1).perturb(name, weight))


def score(model: Path, tp: int, noise: str | None) -> subprocess.CompletedProcess:
    env = child_environ()
    if noise is not None:
        env["SHARDLINE_WEIGHT_NOISE"] = noise
    return subprocess.run([sys.executable, "-m", "services.cli", "score", "--model", str(model), "--tp", str(tp),
                           "--ids", IDS, "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def logprobs(result: subprocess.CompletedProcess) -> torch.Tensor:
    assert result.returncode == 0, result.stderr
    return torch.tensor(json.loads(result.stdout)["logprobs"], dtype=torch.float64)


@pytest.mark.slow
def test_tp1_and_tp2_load_the_same_perturbed_weights(tiny_model_dir: Path) -> None:
    spec = "layer=1,std=0.3,seed=3"
    clean = logprobs(score(tiny_model_dir, 1, None))
    tp1_run = score(tiny_model_dir, 1, spec)
    tp1, tp2 = logprobs(tp1_run), logprobs(score(tiny_model_dir, 2, spec))
    assert (tp1 - tp2).abs().max() < 1e-4  # the same weights; only the all-reduce's summation order differs
    assert (tp1 - clean).abs().max() > 0.01
    warnings = [line for line in tp1_run.stderr.splitlines()
                if line.startswith("SHARDLINE_WEIGHT_NOISE: rank 0 perturbed")]
    assert len(warnings) == len(LAYER_LINEAR_WEIGHTS), tp1_run.stderr
    assert any("model.layers.1.mlp.down_proj.weight [256, 512]" in line and "std 0.3" in line for line in warnings)

    bad_tp1 = score(tiny_model_dir, 1, "layer=9,std=0.3")
    assert bad_tp1.returncode == 2
    assert "SHARDLINE_WEIGHT_NOISE: layer=9, but the model has 4 layers" in bad_tp1.stderr
    bad_tp2 = score(tiny_model_dir, 2, "layer=1,std=big")
    assert bad_tp2.returncode == 1 and "replica group failed" in bad_tp2.stderr
    assert "rank 1: WeightNoiseSpecError: SHARDLINE_WEIGHT_NOISE='layer=1,std=big'" in bad_tp2.stderr
