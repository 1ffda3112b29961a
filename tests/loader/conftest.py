"""Fixtures for the loader: tiny HF checkpoints, their shards, and a real S3-API server (moto)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.loader.manifest import Manifest
from services.loader.writer import ShardJob, write_shards
from tests.stack import free_port

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


# -- a real S3-API server ------------------------------------------------------------------------

@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server on loopback, with dummy credentials in the environment
    (inherited by spawned ranks). Yields its endpoint URL."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except urllib.error.HTTPError:
            break  # it answers: up
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not answer on {endpoint} within 30 s") from None
            time.sleep(0.2)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "SHARDLINE_S3_ENDPOINT_URL": endpoint}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket on the moto server; returns its name."""
    import boto3

    name = f"shardline-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name
