"""Batch-1 decode, paired: shardline and a peer up side by side, one request at a time, alternating.

``python -m bench.decode_pairs [--model 1b-class] [--peer llama.cpp|vllm] [--pairs 24]
[--prompt-tokens 128] [--output-tokens 64] [--isa native|avx2] [--name decode-pairs-1b]``

``bench.serving`` times each server minutes apart, and on a shared VM the memory rate moves by
15-40 % from minute to minute, more than the batch-1 gap it tries to size (a batch-1 step reads
every weight once: its time is the memory rate's). Here both servers are up at once and idle in
turn: each pair sends the same prompt to one and then the other (the order alternating pair by
pair), streams ``--output-tokens`` tokens at temperature 0 with ``ignore_eos``, and takes TPOT as
(last chunk - first chunk) / (tokens - 1), the definition ``vllm bench serve`` uses. The figure
is the median over pairs of ours / the peer's, so a slow minute lands on both sides of a pair.
Both servers load the same weights (llama.cpp the bf16 GGUF of the same HF directory, with
``bench.serving``'s flags) and use the peers set up by ``bench.serving`` under ``--cache``.
Writes ``bench/results/NAME.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from bench._peers import SERVED_NAME, Cache, Server, hold_to_isa, llama_server, shardline_server, vllm_server
from bench.common import machine, publish_results
from bench.serving import MODELS, model_dir_for
from bench.soak import REPO

PORTS = {"shardline": 18_700, "llama.cpp": 18_710, "vllm": 18_720}


def stream_tpot(server: Server, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One streamed completion: its TTFT and TPOT in seconds."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:]).get("choices"):
                last = time.perf_counter()
                first = first or last
    if first is None or first == last:
        raise RuntimeError(f"{server.name}: fewer than two chunks streamed")
    return {"ttft_s": first - t0, "tpot_s": (last - first) / (max_tokens - 1)}


def prompts(tokenizer: Tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn at random from the vocabulary's ordinary tokens."""
    rng = random.Random(seed)
    vocab = [i for i in range(tokenizer.get_vocab_size()) if tokenizer.id_to_token(i).isalpha()]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(n)]


def markdown(payload: dict) -> str:
    s = payload["summary"]
    peer = payload["config"]["peer"]
    lines = [f"# Batch-1 decode, paired with {peer} (`{payload['name']}`)", "",
             f"Machine: {payload['machine']}. Model: {payload['config']['model']} {payload['config']['dtype']}, "
             f"{payload['config']['prompt_tokens']} prompt tokens, {payload['config']['output_tokens']} out, "
             f"{payload['config']['pairs']} pairs, order alternating. Command: `{payload['command']}`.", "",
             "| | shardline | " + peer + " | ours / peer |", "|---|---|---|---|",
             f"| median TPOT | {s['shardline']['tpot_ms']:.2f} ms | {s[peer]['tpot_ms']:.2f} ms | "
             f"**{s['tpot_ratio']:.3f}** (pairs' median; IQR {s['tpot_ratio_q1']:.3f}-{s['tpot_ratio_q3']:.3f}) |",
             f"| median TTFT | {s['shardline']['ttft_ms']:.1f} ms | {s[peer]['ttft_ms']:.1f} ms | "
             f"{s['ttft_ratio']:.3f} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_pairs", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/shardline-bench"))
    parser.add_argument("--model", default="1b-class", choices=MODELS)
    parser.add_argument("--peer", default="llama.cpp", choices=("llama.cpp", "vllm"))
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--isa", default="native", choices=("native", "avx2"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="results name (default decode-pairs-<model>)")
    args = parser.parse_args(argv)
    name = args.name or f"decode-pairs-{args.model}"
    os.chdir(REPO)  # the presets are made under the repo's .models/
    model_dir = model_dir_for(args.model)
    cache = Cache(args.cache.expanduser().resolve(), isa=args.isa)
    hold_to_isa(args.isa)
    cache.setup(model_dir, llama=args.peer == "llama.cpp")
    ours = shardline_server(model_dir, "bfloat16", PORTS["shardline"], cache.root / "shardline-pairs" / model_dir.name)
    peer = (llama_server(cache, model_dir, "bf16", PORTS["llama.cpp"]) if args.peer == "llama.cpp"
            else vllm_server(cache, model_dir, "bfloat16", PORTS["vllm"]))
    servers = {"shardline": ours, args.peer: peer}
    batch = prompts(Tokenizer.from_file(str(model_dir / "tokenizer.json")), args.pairs, args.prompt_tokens, args.seed)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in servers}
    try:
        for server in servers.values():
            server.start()
            stream_tpot(server, batch[0], 8)  # warm: the first request's one-time costs
        for i, prompt in enumerate(batch):
            order = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for n in order:
                runs[n].append(stream_tpot(servers[n], prompt, args.output_tokens))
            print(f"pair {i}: " + ", ".join(f"{n} {runs[n][-1]['tpot_s'] * 1e3:.2f} ms" for n in order), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    ratios = sorted(a["tpot_s"] / b["tpot_s"] for a, b in zip(runs["shardline"], runs[args.peer], strict=True))
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    summary = {n: {"tpot_ms": statistics.median(r["tpot_s"] for r in rs) * 1e3,
                   "ttft_ms": statistics.median(r["ttft_s"] for r in rs) * 1e3} for n, rs in runs.items()}
    summary |= {"tpot_ratio": statistics.median(ratios), "tpot_ratio_q1": q1, "tpot_ratio_q3": q3,
                "ttft_ratio": statistics.median(a["ttft_s"] / b["ttft_s"]
                                                for a, b in zip(runs["shardline"], runs[args.peer], strict=True))}
    payload = {"name": name, "machine": machine(), "command": "python -m bench.decode_pairs "
               + " ".join(argv if argv is not None else sys.argv[1:]),
               "config": {"model": args.model, "dtype": "bfloat16", "peer": args.peer, "pairs": args.pairs,
                          "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "isa": args.isa},
               "summary": summary, "runs": runs}
    return publish_results(name, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
