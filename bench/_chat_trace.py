"""A multi-turn chat trace for ``bench.prefix_serving``: conversations whose every turn re-sends
the whole history (what a chat application sends), streamed through ``/v1/completions``.

Each conversation starts from one of a few shared system prompts; each turn appends a user
message of ``user_words`` words drawn from a fixed vocabulary (seeded) and asks for
``output_tokens`` tokens (``ignore_eos``, temperature 0); the answer's text joins the history. A
turn's TTFT is from sending to the first streamed text. ``concurrency`` conversations run at
once, each turn after the previous one's answer, as a user waits for a reply.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

WORDS = ("data model cache token prompt answer system user request server latency memory block layer "
         "shard router group queue batch stream reply history question planet river mountain garden "
         "library music window engine signal market energy forest ocean harbor bridge lantern").split()


@dataclass(frozen=True)
class ChatTrace:
    conversations: int = 8
    turns: int = 6
    concurrency: int = 4
    system_prompts: int = 2
    system_words: int = 400
    user_words: int = 60
    output_tokens: int = 64
    seed: int = 0


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _turn(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, str, int]:
    """(TTFT s, total s, answer text, streamed chunks with text) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    first, parts, chunks = None, [], 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or []
            text = choices[0].get("text", "") if choices else ""
            if text:
                if first is None:
                    first = time.perf_counter() - start
                parts.append(text)
                chunks += 1
    return first if first is not None else float("nan"), time.perf_counter() - start, "".join(parts), chunks


def run(url: str, model: str, trace: ChatTrace) -> dict[str, Any]:
    """Every turn's TTFT, by turn index; medians, output chunks/s and failures."""
    rng = random.Random(trace.seed)
    systems = [f"System: you are assistant number {i}. {_words(rng, trace.system_words)}\n"
               for i in range(trace.system_prompts)]
    users = [[_words(rng, trace.user_words) for _ in range(trace.turns)] for _ in range(trace.conversations)]
    ttft_by_turn: list[list[float]] = [[] for _ in range(trace.turns)]
    failed, chunks = [0], [0]
    lock = threading.Lock()

    def conversation(index: int) -> None:
        history = systems[index % len(systems)]
        with httpx.Client(timeout=600) as client:
            for turn in range(trace.turns):
                history += f"User: {users[index][turn]}\nAssistant:"
                try:
                    ttft, _, answer, n = _turn(client, url, model, history, trace.output_tokens)
                except httpx.HTTPError:
                    with lock:
                        failed[0] += 1
                    return
                history += answer + "\n"
                with lock:
                    ttft_by_turn[turn].append(ttft)
                    chunks[0] += n

    start = time.perf_counter()
    with ThreadPoolExecutor(trace.concurrency) as pool:
        list(pool.map(conversation, range(trace.conversations)))
    elapsed = time.perf_counter() - start
    every = [t for turn in ttft_by_turn for t in turn]
    return {
        "median_ttft_ms": round(statistics.median(every) * 1000, 1) if every else None,
        "median_ttft_ms_by_turn": [round(statistics.median(t) * 1000, 1) if t else None for t in ttft_by_turn],
        "output_chunks_per_s": round(chunks[0] / elapsed, 2),
        "turns_done": len(every), "failed": failed[0], "seconds": round(elapsed, 1),
    }
