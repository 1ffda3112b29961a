"""Shared pieces of the benchmarks: models to run on, timing, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from services.modeling.gguf_import import convert_smollm2

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in HF layout under .models/ (converted from the wheel's GGUF once)."""
    out = REPO / ".models" / "smollm2-bench"
    if not (out / "model.safetensors").exists():
        convert_smollm2(out, dtype="float32")
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
