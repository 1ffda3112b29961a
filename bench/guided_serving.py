"""What a JSON-schema constraint costs a served stream, ours against vLLM's CPU build in one run:
TPOT of streamed chat completions with ``response_format: json_schema`` over TPOT without, at
c=1 and c=16, SmolLM2-135M-Instruct bfloat16, one server at a time, the same client.

Every request asks for 64 tokens (``ignore_eos``); the schema is ``bench.guided``'s, an object holding
an array of at least 200 integers, so every one of the 64 tokens is guided. A request's TPOT is (last token −
first token) / (tokens − 1), from its stream's arrival times; a figure is the median over the
requests of the rounds, which alternate guided and free. vLLM picks its own structured-output
backend (``auto``); ours is llguidance.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench._peers import SERVED_NAME, Cache, Server, shardline_server, vllm_server
from bench.common import machine, smollm2_dir, write_results
from bench.guided import MAX_TOKENS, SCHEMA
from services.common.ports import free_port


def stream_tpot(base_url: str, i: int, guided: bool) -> float:
    """One streamed request's TPOT in seconds."""
    body = {"model": SERVED_NAME, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"List some numbers, please ({i})."}]}
    if guided:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": SCHEMA}}
    first = last = None
    tokens = 0
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if '"content":"' in line and '"content":""' not in line:
                last = time.monotonic()
                first = first or last
            if '"completion_tokens":' in line and '"choices":[]' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
    if first is None or tokens < 2:
        raise RuntimeError(f"a stream of {tokens} tokens")
    return (last - first) / (tokens - 1)


def tpots(base_url: str, concurrency: int, guided: bool, requests: int) -> list[float]:
    """TPOT of ``requests`` streams, ``concurrency`` at a time."""
    out: list[float] = []
    errors: list[BaseException] = []
    for start in range(0, requests, concurrency):
        def one(i: int) -> None:
            try:
                out.append(stream_tpot(base_url, i, guided))
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on the caller's thread
                errors.append(exc)
        threads = [threading.Thread(target=one, args=(start + k,)) for k in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return out


def measure(server: Server, rounds: int) -> list[dict]:
    server.start()
    try:
        tpots(server.base_url, 2, True, 2)
        tpots(server.base_url, 2, False, 2)  # warm-up: kernels, the grammar compiler
        rows = []
        for c in (1, 16):
            free: list[float] = []
            guided: list[float] = []
            for _ in range(rounds):
                free += tpots(server.base_url, c, False, max(c, 4))
                guided += tpots(server.base_url, c, True, max(c, 4))
            rows.append({"server": server.name, "concurrency": c, "free_tpot_ms": statistics.median(free) * 1e3,
                         "guided_tpot_ms": statistics.median(guided) * 1e3,
                         "ratio": statistics.median(guided) / statistics.median(free)})
            print(rows[-1], flush=True)
        return rows
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", nargs="+", default=["shardline", "vllm"], choices=["shardline", "vllm"])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "shardline-bench")
    args = parser.parse_args(argv)
    cache = Cache(args.cache)
    model = smollm2_dir()
    cache.setup(model, llama=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="guided-serving-") as tmp:
        for name in args.servers:
            server = shardline_server(model, "bfloat16", free_port(), Path(tmp)) if name == "shardline" else \
                vllm_server(cache, model, "bfloat16", free_port())
            rows += measure(server, args.rounds)
    info = machine()
    lines = ["# Structured outputs served: TPOT with a JSON-schema response_format / without, ours and vLLM-CPU", "",
             f"`python -m bench.guided_serving --rounds {args.rounds}`; {info['cpu_model']}, 2 cores; SmolLM2-135M-"
             f"Instruct bfloat16, streamed chat, {MAX_TOKENS} tokens each (ignore_eos, greedy), every token guided; "
             f"medians over {args.rounds} alternating rounds; one server at a time.", "",
             "| server | c | TPOT without ms | TPOT guided ms | guided / without |", "|---|---|---|---|---|"]
    lines += [f"| {r['server']} | {r['concurrency']} | {r['free_tpot_ms']:.2f} | {r['guided_tpot_ms']:.2f} | "
              f"{r['ratio']:.3f} |" for r in rows]
    write_results("guided-serving", {"machine": info, "schema": SCHEMA, "rows": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
