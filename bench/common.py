"""Shared pieces of the benchmarks: models to run on, timing, result files."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from services.modeling.gguf_import import convert_smollm2
from services.modeling.tiny import TinyModelSpec, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in HF layout under .models/ (converted from the wheel's GGUF once)."""
    out = REPO / ".models" / "smollm2-bench"
    if not (out / "model.safetensors").exists():
        convert_smollm2(out, dtype="float32")
    return out


# The 1B-class Llama shape the serving benchmarks also run (Llama-3.2-1B's layers, heads and
# widths); with SmolLM2's 49,152-token vocabulary, untied, about 1.17B parameters
ONE_B_CLASS = {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "intermediate": 8192}


def one_b_class_dir(tokenizer_from: Path) -> Path:
    """The 1B-class shape with random weights (seed 0), bfloat16, in HF layout under .models/ (made
    once), with the tokenizer and special tokens of ``tokenizer_from`` (SmolLM2's), so that every
    server, llama.cpp's GGUF converter and the benchmark client read the same text the same way."""
    out = REPO / ".models" / "llama-1b-class"
    if (out / "model.safetensors").exists():
        return out
    source = json.loads((tokenizer_from / "config.json").read_text())
    spec = TinyModelSpec(**ONE_B_CLASS, vocab=source["vocab_size"], max_position=4096, rope_theta=source["rope_theta"],
                         dtype="bfloat16")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_tiny_model(spec, partial)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_from / name).exists():
            shutil.copyfile(tokenizer_from / name, partial / name)
    config = json.loads((partial / "config.json").read_text())
    config.update({k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in source})
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial.rename(out)
    return out


def median_time(fn: Callable[[], object], *, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_model() -> tuple[str, list[str]]:
    """The CPU's model name and its vector extensions (AVX2, AVX-512, AMX), from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return name, sorted(f for f in set(flags) if f == "avx2" or f.startswith(("avx512", "amx")))


def machine() -> dict:
    name, flags = cpu_model()
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_model": name, "cpu_flags": flags, "cuda": torch.cuda.is_available()}


def write_results(name: str, payload: dict, markdown: str, *, out_dir: Path = RESULTS) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def publish_results(name: str, payload: dict, markdown: str) -> int:
    """Write ``bench/results/NAME.{json,md}``, print the markdown and where it went; 0 (an exit code)."""
    json_path, md_path = write_results(name, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")
    return 0


def wait_http_health(proc, url: str, timeout_s: float, name: str, tail: Callable[[], str], *,
                     poll_s: float = 0.25) -> float:
    """Seconds from now until ``GET url`` answers 200 while ``proc`` (a started Popen) runs;
    RuntimeError with the log's ``tail()`` if it exits first or ``timeout_s`` passes."""
    import httpx  # deferred: the benches that start no server do not need it

    t0 = time.monotonic()
    with httpx.Client(timeout=5) as http:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail()}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{name} was not healthy within {timeout_s:.0f} s:\n{tail()}")
            try:
                if http.get(url).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
