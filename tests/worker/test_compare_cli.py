"""`shardline compare` on the tiny model: plans that only re-shard agree to rounding, bfloat16
moves the numbers a little, a perturbed copy of the weights moves them a lot, and a bad plan
is refused with exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]


def compare(model: Path, reference: str, candidate: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "compare", "--model", str(model),
                           "--reference", reference, "--candidate", candidate, "--chunks", "2",
                           "--chunk-tokens", "64", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def figures(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_resharding_agrees_and_bfloat16_drifts_a_little(tiny_model_dir: Path) -> None:
    same = figures(compare(tiny_model_dir, "dtype=float32", "tp=2,pp=2", "--json"))
    assert same["scored_tokens"] == 126 and same["chunks"] == 2
    assert abs(same["perplexity_delta_pct"]) < 1e-3 and same["max_abs_logprob_delta"] < 1e-4
    assert same["top1_agreement"] == 1.0
    bf16 = figures(compare(tiny_model_dir, "dtype=float32", "dtype=bfloat16", "--json"))
    assert 0 < bf16["mean_abs_logprob_delta"] < 0.05 and abs(bf16["perplexity_delta_pct"]) < 1.0


def test_perturbed_weights_are_far(tiny_model_dir: Path, tmp_path: Path) -> None:
    noisy = tmp_path / "tiny-noisy"
    shutil.copytree(tiny_model_dir, noisy)
    weights = load_file(noisy / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    w = weights["model.layers.1.mlp.down_proj.weight"]
    weights["model.layers.1.mlp.down_proj.weight"] = w + torch.randn(w.shape, generator=generator) * w.std() * 3
    save_file(weights, noisy / "model.safetensors", metadata={"format": "pt"})
    far = figures(compare(tiny_model_dir, "dtype=float32", f"model={noisy}", "--json"))
    assert far["perplexity_delta_pct"] > 1.0 and far["top1_agreement"] < 0.95
    assert far["mean_abs_logprob_delta"] > 0.05  # beyond the bound bfloat16 stays under
    text = compare(tiny_model_dir, "dtype=float32", "dtype=float32")
    assert text.returncode == 0 and "perplexity delta +0.000 %" in text.stdout
    assert "top-1 agreement 1.0000" in text.stdout


def test_bad_plans_exit_2(tiny_model_dir: Path) -> None:
    for bad in ("tq=2", "tp=x", "tp=3"):
        result = compare(tiny_model_dir, "dtype=float32", bad)
        assert result.returncode == 2, (bad, result.stdout, result.stderr)
        assert "shardline compare:" in result.stderr
