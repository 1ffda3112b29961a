"""The soak bench's load: streaming clients that mix normal, cancelled and malformed requests.

Normal and cancelled requests go through the real ``openai`` client (completions and chat,
streamed, with usage); malformed ones through ``httpx``, since the ``openai`` client will not
send a broken body. Every request ends in one outcome; every malformed kind has the status it
must get. A 5xx anywhere is counted apart: the soak's first verdict is that it stays 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three laws of thermodynamics are", "Write a haiku about the sea.", "List five prime numbers:",
           "In 1969, the first person to walk on the moon", "A recipe for bread: first,"]
MAX_TOKENS = (16, 96)  # each normal stream asks for a length drawn in this range
OVERSIZE_EXTRA_BYTES = 4096  # the oversize body is the router's limit plus this
ROUTER_MAX_BODY_BYTES = 8 * 2**20  # the router's default --max-body-bytes (services/router/edge.py)
SAMPLE_ERRORS = 5  # messages kept per error class
BUCKETS = 10  # outcomes, tokens and gaps are also kept per tenth of the load (at least 5 s)


Variant = Callable[[], tuple[str, bytes, str]]  # () -> (path, body, content type)


def _malformed(model: str) -> dict[str, tuple[int, dict[str, Variant]]]:
    """kind -> (the status it must get, variant name -> the request)."""
    m = model.encode()

    def body(**fields: Any) -> bytes:
        return json.dumps({"model": model, "max_tokens": 8, **fields}).encode()

    def completion(raw: bytes, content_type: str = "application/json") -> Variant:
        return lambda: ("/completions", raw, content_type)

    oversize = b'{"model": "%s", "prompt": "%s"}' % (m, b"a" * (ROUTER_MAX_BODY_BYTES + OVERSIZE_EXTRA_BYTES))
    return {
        "bad_json": (400, {
            "truncated": completion(b'{"model": "%s", "prompt": "hi",' % m),
            "not_json": completion(b"{not json}"),
            "trailing_brace": completion(b'{"prompt": "a"}}'),
            "array": completion(b"[1, 2, 3]"),
            "empty": completion(b""),
            "nested_100k": completion(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
            "nan": completion(b'{"model": "%s", "prompt": NaN}' % m),
            "not_utf8": completion(b"\xff\xfe{}"),
        }),
        "wrong_content_type": (415, {
            "text_plain": completion(body(prompt="hi"), "text/plain"),
            "form": completion(body(prompt="hi"), "application/x-www-form-urlencoded"),
        }),
        "out_of_range": (400, {
            "max_tokens_50_digits": completion(body(prompt="hi", max_tokens=int("9" * 50))),
            "max_tokens_5000_digits": completion(b'{"model": "%s", "prompt": "hi", "max_tokens": %s}'
                                                 % (m, b"9" * 5000)),
            "max_tokens_negative": completion(body(prompt="hi", max_tokens=-3)),
            "top_k_2^32": completion(body(prompt="hi", top_k=2**32)),
            "stop_token_id_2^32": completion(body(prompt="hi", stop_token_ids=[2**32 + 1])),
            "temperature_1e39_stream": completion(body(prompt="hi", temperature=1e39, stream=True)),
            "top_p_5e-324_stream": completion(body(prompt="hi", top_p=5e-324, stream=True)),
            "logprobs_10000": completion(body(prompt="hi", logprobs=10_000)),
        }),
        "lone_surrogate": (400, {
            "prompt": completion(b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 4}' % m),
            "chat": lambda: ("/chat/completions",
                             b'{"model": "%s", "messages": [{"role": "user", "content": "x\\udc00"}]}' % m,
                             "application/json"),
        }),
        "null_content": (400, {
            "chat": lambda: ("/chat/completions", body(messages=[{"role": "user", "content": None}]),
                             "application/json"),
        }),
        "oversize": (413, {"8MiB+4KiB": completion(oversize)}),
    }


@dataclass
class Stats:
    """Everything the clients saw; one instance shared by all (one event loop, no locks)."""

    outcomes: Counter = field(default_factory=Counter)  # completed, cancelled, malformed_rejected, ...
    errors: Counter = field(default_factory=Counter)  # error class -> count (only what went wrong)
    error_samples: dict[str, list[str]] = field(default_factory=dict)
    malformed: dict[str, Counter] = field(default_factory=dict)  # "kind.variant" -> status -> count
    expected: dict[str, int] = field(default_factory=dict)  # "kind.variant" -> the status it must get
    status_5xx: int = 0
    gaps_s: list[float] = field(default_factory=list)  # inter-token gaps of the normal streams
    ttft_s: list[float] = field(default_factory=list)
    tokens: int = 0  # completion tokens streamed (normal and cancelled streams)
    bucket_s: float = 10.0
    buckets: dict[float, dict[str, Any]] = field(default_factory=dict)  # start (s) -> that slice of the load

    def bucket(self, t0: float) -> dict[str, Any]:
        key = round((time.monotonic() - t0) // self.bucket_s * self.bucket_s, 1)
        return self.buckets.setdefault(key, {"outcomes": Counter(), "tokens": 0, "gaps_s": []})

    def error(self, cls: str, message: str) -> None:
        self.errors[cls] += 1
        samples = self.error_samples.setdefault(cls, [])
        if len(samples) < SAMPLE_ERRORS:
            samples.append(message[:300])

    def end(self, t0: float, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.bucket(t0)["outcomes"][outcome] += 1


class Load:
    """``streams`` client loops until ``deadline``, each request drawn as malformed with
    probability ``malformed_share``, cancelled mid-stream with ``cancel_share``, else normal."""

    def __init__(self, base_url: str, model: str, *, streams: int, malformed_share: float, cancel_share: float,
                 seed: int = 0, timeout_s: float = 120.0) -> None:
        self.base_url, self.model, self.streams = base_url, model, streams
        self.malformed_share, self.cancel_share = malformed_share, cancel_share
        self.seed, self.timeout_s = seed, timeout_s
        self.kinds = _malformed(model)
        names = {f"{kind}.{v}": status for kind, (status, variants) in self.kinds.items() for v in variants}
        self.stats = Stats(malformed={name: Counter() for name in names}, expected=names)

    async def run(self, duration_s: float) -> Stats:
        self.stats.bucket_s = max(5.0, duration_s / BUCKETS)
        limits = httpx.Limits(max_connections=self.streams * 2, max_keepalive_connections=self.streams)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, limits=limits) as raw, \
                openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=self.timeout_s,
                                   http_client=httpx.AsyncClient(timeout=self.timeout_s, limits=limits)) as client:
            self.t0 = time.monotonic()
            deadline = self.t0 + duration_s
            await asyncio.gather(*(self._loop(i, client, raw, deadline) for i in range(self.streams)))
        return self.stats

    async def _loop(self, i: int, client: openai.AsyncOpenAI, raw: httpx.AsyncClient, deadline: float) -> None:
        rng = random.Random(self.seed * 100_003 + i)
        await asyncio.sleep(rng.random() * 0.5)  # not all at the same instant
        while time.monotonic() < deadline:
            draw = rng.random()
            try:
                if draw < self.malformed_share:
                    await self._malformed_request(rng, raw)
                else:
                    await self._stream(rng, client, cancel=draw < self.malformed_share + self.cancel_share)
            except Exception as exc:  # noqa: BLE001 - a bench bug must not end the loop silently
                self.stats.error(f"client_bug:{type(exc).__name__}", repr(exc))
                self.stats.end(self.t0, "client_bug")

    async def _malformed_request(self, rng: random.Random, raw: httpx.AsyncClient) -> None:
        kind = rng.choice(sorted(self.kinds))
        expected, variants = self.kinds[kind]
        variant = rng.choice(sorted(variants))
        path, content, content_type = variants[variant]()
        name = f"{kind}.{variant}"
        try:
            response = await raw.post(path, content=content, headers={"content-type": content_type})
        except httpx.HTTPError as exc:
            self.stats.error(f"malformed_connection:{name}", f"{type(exc).__name__}: {exc}")
            self.stats.end(self.t0, "malformed_connection_error")
            return
        status = response.status_code
        self.stats.malformed[name][str(status)] += 1
        if status >= 500:
            self.stats.status_5xx += 1
        if status == expected and _is_openai_error(response):
            self.stats.end(self.t0, "malformed_rejected")
        else:
            self.stats.error(f"malformed_{name}_got_{status}", response.text[:300])
            self.stats.end(self.t0, "malformed_unexpected")

    async def _stream(self, rng: random.Random, client: openai.AsyncOpenAI, *, cancel: bool) -> None:
        max_tokens = rng.randint(*MAX_TOKENS)
        cut_after = rng.randint(1, max(1, max_tokens // 2)) if cancel else None
        chat = rng.random() < 0.5
        common: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                                  "temperature": rng.choice([0.0, 0.8]), "stream_options": {"include_usage": True}}
        prompt = rng.choice(PROMPTS)
        start = time.monotonic()
        try:
            if chat:
                stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
            else:
                stream = await client.completions.create(prompt=prompt, **common)
        except openai.APIStatusError as exc:
            self._status_error(exc)
            return
        except openai.APIConnectionError as exc:
            self.stats.error("connection", f"{type(exc).__name__}: {exc}")
            self.stats.end(self.t0, "connection_error")
            return
        arrivals: list[float] = []
        finish, usage_tokens, seen = None, None, 0
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                text = choice.delta.content if chat else choice.text
                if text:
                    arrivals.append(time.monotonic())
                    seen += 1
                if choice.finish_reason:
                    finish = choice.finish_reason
                if cut_after is not None and seen >= cut_after:
                    await stream.close()  # the client goes away mid-stream
                    break
        except openai.APIError as exc:  # an error event inside the stream, or a broken connection
            self.stats.error("stream_error_event" if not isinstance(exc, openai.APIConnectionError)
                             else "stream_connection", f"{type(exc).__name__}: {exc}")
            self.stats.end(self.t0, "stream_error")
            return
        except httpx.HTTPError as exc:
            self.stats.error("stream_transport", f"{type(exc).__name__}: {exc}")
            self.stats.end(self.t0, "stream_error")
            return
        if arrivals:
            self.stats.ttft_s.append(arrivals[0] - start)
        if cut_after is not None and seen >= cut_after:
            self.stats.tokens += seen
            self.stats.bucket(self.t0)["tokens"] += seen
            self.stats.end(self.t0, "cancelled")
            return
        if finish is None:
            self.stats.error("stream_cut", f"{'chat' if chat else 'completion'} stream ended after {seen} chunks "
                                           f"with no finish_reason")
            self.stats.end(self.t0, "stream_error")
            return
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        tokens = usage_tokens if usage_tokens is not None else seen
        self.stats.gaps_s.extend(gaps)
        self.stats.tokens += tokens
        bucket = self.stats.bucket(self.t0)
        bucket["gaps_s"].extend(gaps)
        bucket["tokens"] += tokens
        self.stats.end(self.t0, "completed" if not cancel else "completed_before_cancel")

    def _status_error(self, exc: openai.APIStatusError) -> None:
        status = exc.status_code
        if status >= 500:
            self.stats.status_5xx += 1
        self.stats.error(f"http_{status}", str(exc))
        self.stats.end(self.t0, f"http_{status // 100}xx")


def _is_openai_error(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]
