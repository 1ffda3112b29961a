"""llguidance against xgrammar on this CPU: what a guided token costs each structured-outputs engine.

SmolLM2-135M-Instruct's tokenizer (49,152 ids) and three JSON schemas: ``bench.guided``'s (an
array of at least 200 integers), ``bench.structured_outputs``'s nested ``Task`` (enums, arrays of
objects, bounded strings and integers), and the ``required`` tool choice's array of calls. For
each engine and schema:

- start: compiling the schema, making a matcher and its first mask (what a request waits for
  before its first guided token), cold, the median of fresh compilers;
- per token: the mask of allowed next tokens, then the step past the sampled token, walked along
  a valid answer token by token (what a guided decode step adds), median and p99 in µs.

xgrammar is not a dependency of the project: on first use this installs it (and its FFI runtime,
not its torch or triton requirements, which this environment already has or does not need on a
CPU) into ``~/.cache/shardline-bench/xgrammar``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import machine, smollm2_dir, write_results
from bench.guided import SCHEMA as FLAT_SCHEMA
from bench.structured_outputs import GetWeather, Task
from services.common.guided import grammar_of

CACHE = Path.home() / ".cache" / "shardline-bench" / "xgrammar"
XGRAMMAR = ("xgrammar==0.2.9", "apache-tvm-ffi>=0.1.11")

TASK_ANSWER = {"name": "File the 2025 taxes", "priority": "high", "tags": ["money", "work"],
               "steps": [{"title": "Collect the forms", "minutes": 45}, {"title": "Fill in the return", "minutes": 90},
                         {"title": "Submit it online", "minutes": 15}], "done": False}
TOOLS_SCHEMA = {"type": "array", "minItems": 1, "maxItems": 1, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "parameters"],
    "properties": {"name": {"enum": ["get_weather"]}, "parameters": GetWeather.model_json_schema()}}}
TOOLS_ANSWER = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]
FLAT_ANSWER = {"xs": [(i * 37) % 1000 for i in range(200)]}  # bench.guided's schema: 200 integers at least


def run_with_xgrammar(argv: list[str]) -> int | None:
    """None where xgrammar imports here; else xgrammar installed into CACHE (once) and this
    benchmark run again in a process with CACHE on its PYTHONPATH (its exit status)."""
    if importlib.util.find_spec("xgrammar") is not None:
        return None
    if not (CACHE / "xgrammar").is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(CACHE),
                        *XGRAMMAR], check=True)
    paths = [str(CACHE), *filter(None, [os.environ.get("PYTHONPATH")])]
    return subprocess.run([sys.executable, "-m", "bench.grammar_engines", *argv],
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)}).returncode


def xgrammar_module():
    import xgrammar  # deferred: a peer's package, on the path only where run_with_xgrammar put it

    return xgrammar


class Llguidance:
    name = "llguidance"

    def __init__(self, model_dir: Path, vocab_size: int, eos: int) -> None:
        import llguidance  # deferred: the engine the project uses, imported as its worker does

        self.llg = llguidance
        from llguidance.numpy import fill_next_token_bitmask  # deferred: as above

        self.fill = fill_next_token_bitmask
        self.tokenizer = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab_size,
                                                eos_token=eos)
        self.words = (vocab_size + 31) // 32

    def start(self, schema: str):
        matcher = self.llg.LLMatcher(self.tokenizer, grammar_of("json_schema", schema), log_level=0)
        mask = np.zeros((1, self.words), dtype=np.int32)
        self.fill(matcher, mask, 0)
        return matcher, mask

    def step(self, state, token: int) -> None:
        matcher, mask = state
        self.fill(matcher, mask, 0)
        assert mask[0, token // 32] >> (token % 32) & 1, f"llguidance refused token {token}"
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, model_dir: Path, vocab_size: int, eos: int) -> None:
        from transformers import AutoTokenizer  # deferred: only where xgrammar needs the HF tokenizer

        self.xgr = xgrammar_module()
        self.info = self.xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir),
                                                            vocab_size=vocab_size, stop_token_ids=[eos])

    def start(self, schema: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        matcher = self.xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False,
                                                                                separators=(",", ":")))
        mask = self.xgr.allocate_token_bitmask(1, self.info.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        return matcher, mask

    def step(self, state, token: int) -> None:
        matcher, mask = state
        matcher.fill_next_token_bitmask(mask)
        assert int(mask[0, token // 32]) >> (token % 32) & 1, f"xgrammar refused token {token}"
        assert matcher.accept_token(token)


def measure(engine, schema: dict, answer, ids_of, starts: int) -> dict:
    text = json.dumps(schema)
    start_ms = []
    for _ in range(starts):
        t0 = time.perf_counter()
        state = engine.start(text)
        start_ms.append((time.perf_counter() - t0) * 1e3)
    ids = ids_of(json.dumps(answer, separators=(",", ":")))
    per_token = []
    for _ in range(3):
        state = engine.start(text)
        for token in ids:
            t0 = time.perf_counter()
            engine.step(state, token)
            per_token.append((time.perf_counter() - t0) * 1e6)
    per_token.sort()
    return {"start_ms": statistics.median(start_ms), "tokens": len(ids), "token_us_p50": statistics.median(per_token),
            "token_us_p99": per_token[int(0.99 * (len(per_token) - 1))]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5, help="fresh compiles per schema and engine (default 5)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    rerun = run_with_xgrammar(argv)
    if rerun is not None:
        return rerun
    model_dir = smollm2_dir()
    config = json.loads((model_dir / "config.json").read_text())
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    from tokenizers import Tokenizer  # deferred: the bench's own tokenizing

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def ids_of(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    schemas = {"200 integers (bench.guided)": (FLAT_SCHEMA, FLAT_ANSWER),
               "nested Task": (Task.model_json_schema(), TASK_ANSWER),
               "tool_choice required": (TOOLS_SCHEMA, TOOLS_ANSWER)}
    engines = [Llguidance(model_dir, vocab, eos), Xgrammar(model_dir, vocab, eos)]
    rows = []
    for label, (schema, answer) in schemas.items():
        for engine in engines:
            row = {"schema": label, "engine": engine.name, **measure(engine, schema, answer, ids_of, args.starts)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    info = machine()
    lines = ["# Structured-outputs engines on this CPU: llguidance and xgrammar", "",
             f"`python -m bench.grammar_engines`; {info['cpu_model']}; SmolLM2-135M-Instruct's tokenizer "
             f"({vocab} ids), one thread, compact JSON (no free whitespace) in both. Start: compile + matcher + "
             "first mask, cold (median of fresh compilers); per token: mask + advance, walking a valid answer "
             "(3 walks).", "",
             "| schema | engine | start ms | answer tokens | per token p50 µs | per token p99 µs |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['schema']} | {r['engine']} | {r['start_ms']:.2f} | {r['tokens']} | {r['token_us_p50']:.1f} | "
              f"{r['token_us_p99']:.1f} |" for r in rows]
    write_results("grammar-engines", {"machine": info, "rows": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
