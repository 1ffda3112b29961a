"""Fixtures for the loader: tiny HF checkpoints and their shards (the S3-API server is suite-wide:
tests/s3_fixtures.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.loader.manifest import Manifest
from services.loader.writer import ShardJob, write_shards

TINY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=512)


def make_hf_model(out: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, tie: bool = False,
                  max_shard_size: str | None = None, **shape: int) -> Path:
    """A random Llama in HF layout, written by transformers itself (the reference writer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_SHAPE, **shape}, tie_word_embeddings=tie)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to exactly 1: perturb them so a missed copy shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.05)
    model.to(dtype).save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return out


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loader-models")


@pytest.fixture(scope="session")
def tiny_dir(models_root: Path) -> Path:
    return make_hf_model(models_root / "tiny", seed=0)


@pytest.fixture(scope="session")
def other_dir(models_root: Path) -> Path:
    """Same shape as ``tiny_dir``, other weights: only the fingerprint tells them apart."""
    return make_hf_model(models_root / "other", seed=1)


@pytest.fixture(scope="session")
def tied_dir(models_root: Path) -> Path:
    return make_hf_model(models_root / "tied", seed=2, tie=True)


@pytest.fixture(scope="session")
def bf16_dir(models_root: Path) -> Path:
    return make_hf_model(models_root / "bf16", seed=3, dtype=torch.bfloat16)


ShardedFn = Callable[..., Path]


@pytest.fixture(scope="session")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> ShardedFn:
    """``sharded(model_dir, tp, pp, dtype=None)`` → a directory with shards + manifest.json,
    written once per session; tests that damage files take :func:`copy_checkpoint` first."""
    done: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("loader-shards")

    def make(model_dir: Path, tp: int, pp: int, dtype: str | None = None) -> Path:
        key = (str(model_dir), tp, pp, dtype)
        if key not in done:
            out = root / f"{model_dir.name}-tp{tp}-pp{pp}-{dtype or 'native'}"
            write_shards(ShardJob(model_dir, tp, pp, str(out), dtype=dtype), progress=False)
            done[key] = out
        return done[key]

    return make


def copy_checkpoint(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def load_manifest(ckpt: Path) -> Manifest:
    return Manifest.load(ckpt / "manifest.json")
