"""Checkpoints quantized by llm-compressor, served without the original weights.

    python -m bench.compressed_tensors [--chunks 32] [--chunk-tokens 512] [--name compressed-tensors]

1. Sets up llm-compressor once in a venv of its own under ``--cache`` (``llmc-venv``: the package
   and its dependencies, the CPU torch this machine keeps on disk), and with it quantizes
   SmolLM2-135M-Instruct data-free (``oneshot`` with a ``QuantizationModifier``, ``ignore:
   lm_head``) into two compressed-tensors directories: ``FP8_DYNAMIC`` (e4m3 weights per output
   channel, activations dynamic per token) and ``W8A8`` (int8 weights per output channel,
   activations int8 dynamic per token), as vLLM users make them.
2. The quality gate on the golden set (``shardline gate``'s scoring, perplexity against the
   bfloat16 plan of the original): each checkpoint served as its own scheme (its lm_head dense, as
   it left it), beside the original quantized on load to the same scheme (lm_head dense too).
3. Each checkpoint served through ``shardline up --dtype <its scheme>`` and asked one greedy chat
   completion (streamed), with the time until ``/health`` answered.

Writes bench/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from bench._peers import OFFLINE_ENV, SERVED_NAME, Server, run_logged, shardline_server
from bench.common import machine, publish_results, smollm2_dir
from services.modeling.compressed_tensors import compressed_format
from services.quality.comparison import compare
from services.quality.gate import golden_set_for, plan_spec, score_plan

LLMCOMPRESSOR_VERSION = "0.14.0.1"
SCHEMES = {"FP8_DYNAMIC": "fp8", "W8A8": "int8"}  # llm-compressor's preset -> the dtype that serves it
PORT = 18300
QUESTION = "What is the capital of France? Answer in one sentence."
# the perplexity bars of bench.quant: int8 within the quality gate's 0.5 %, fp8 within 1 %
BARS = {"int8": 0.5, "fp8": 1.0}

QUANTIZE_SCRIPT = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, out, scheme = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
"""


def llmcompressor_python(cache: Path) -> Path:
    """The venv's python, made (and llm-compressor installed with this repo's pins) the first time."""
    venv = cache / "llmc-venv"
    python = venv / "bin" / "python"
    if not (venv / ".ready").exists():
        log = cache / "logs" / "setup-llmcompressor.log"
        print(f"setup: llm-compressor {LLMCOMPRESSOR_VERSION} (log {log}) ...", flush=True)
        run_logged([sys.executable, "-m", "venv", venv], log)
        run_logged([python, "-m", "pip", "install", "-q", "-c", Path(__file__).parents[1] / "constraints.txt",
                    f"llmcompressor=={LLMCOMPRESSOR_VERSION}"], log)
        (venv / ".ready").write_text(f"llmcompressor=={LLMCOMPRESSOR_VERSION}\n")
    return python


def make_checkpoint(python: Path, source: Path, out: Path, scheme: str, log: Path) -> float:
    """llm-compressor's data-free ``oneshot`` of ``scheme`` on ``source`` into ``out``; seconds taken."""
    t0 = time.monotonic()
    if not (out / "config.json").exists():
        partial = out.with_name(out.name + ".partial")
        run_logged([python, "-c", QUANTIZE_SCRIPT, source, partial, scheme], log,
                   env={**os.environ, **OFFLINE_ENV})
        partial.rename(out)
    return time.monotonic() - t0


def llm_compressor_checkpoint(cache: Path, source: Path, preset: str) -> tuple[Path, float]:
    """llm-compressor's ``preset`` of the HF directory ``source`` (made the first time, under
    ``cache/models``) and the seconds it took."""
    out = cache / "models" / f"{source.name}-{preset.lower()}"
    return out, make_checkpoint(llmcompressor_python(cache), source, out, preset, cache / "logs" / "llmcompressor.log")


def gate(source: Path, checkpoints: dict[str, Path], *, chunks: int, chunk_tokens: int) -> dict:
    texts = {"bfloat16": "dtype=bfloat16"}
    for preset, path in checkpoints.items():
        dtype = SCHEMES[preset]
        texts[f"{dtype} (original, quantized on load)"] = f"dtype={dtype},lm_head=dense"
        texts[f"{dtype} (llm-compressor {preset})"] = f"dtype={dtype},model={path}"
    specs = {name: plan_spec(str(source), text) for name, text in texts.items()}
    golden = golden_set_for(str(source), specs["bfloat16"], chunks=chunks, chunk_tokens=chunk_tokens)
    scores = {name: score_plan(spec, texts[name], golden) for name, spec in specs.items()}
    rows = {}
    for name, spec in specs.items():
        vs = compare(scores["bfloat16"].results, scores[name].results)
        dtype = spec.plan.dtype
        rows[name] = {"plan": texts[name], "dtype": dtype, "lm_head_quantized": bool(spec.plan.lm_head_quant),
                      "perplexity": vs.candidate_perplexity, "ppl_delta_vs_bf16_pct": vs.perplexity_delta_pct,
                      "top1_vs_bf16": vs.top1_agreement, "bar_pct": BARS.get(dtype),
                      "passes": dtype not in BARS or vs.perplexity_delta_pct <= BARS[dtype]}
    return {"chunks": chunks, "chunk_tokens": chunk_tokens, "scored_tokens": golden.scored_tokens, "plans": rows}


def serve_once(path: Path, dtype: str, workdir: Path) -> dict:
    server: Server = shardline_server(path, dtype, PORT, workdir)
    try:
        ready_s = server.start(timeout_s=300)
        body = json.dumps({"model": SERVED_NAME, "messages": [{"role": "user", "content": QUESTION}],
                           "max_tokens": 32, "temperature": 0, "stream": True}).encode()
        request = urllib.request.Request(f"{server.base_url}/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
        pieces, chunks = [], 0
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    for choice in json.loads(line[6:])["choices"]:
                        pieces.append(choice["delta"].get("content") or "")
        return {"ready_s": round(ready_s, 1), "chunks": chunks, "text": "".join(pieces)}
    finally:
        server.stop()


def markdown(payload: dict) -> str:
    g = payload["gate"]
    lines = ["# Checkpoints quantized by llm-compressor (compressed-tensors), served without the original", "",
             f"Machine: {payload['machine']['cpu_model']}, {payload['machine']['cpu_count']} cores. Command: "
             f"`python -m bench.compressed_tensors`. SmolLM2-135M-Instruct quantized data-free by llm-compressor "
             f"{LLMCOMPRESSOR_VERSION} (`oneshot`, `ignore: lm_head`).", "",
             "| checkpoint | as read here | made in (s) |", "|---|---|---|"]
    for preset, c in payload["checkpoints"].items():
        lines.append(f"| {preset} | {c['format']} | {c['seconds']:.0f} |")
    lines += ["", f"Golden set: {g['chunks']} chunks x {g['chunk_tokens']} tokens = {g['scored_tokens']} scored "
              "positions; perplexity against the bfloat16 plan of the original.", "",
              "| plan | lm_head | perplexity | Δ vs bf16 | top-1 vs bf16 | bar | passes |",
              "|---|---|---|---|---|---|---|"]
    for name, r in g["plans"].items():
        bar = f"≤ {r['bar_pct']:g} %" if r["bar_pct"] is not None else "-"
        lines.append(f"| {name} | {'quantized' if r['lm_head_quantized'] else 'dense'} | {r['perplexity']:.4f} | "
                     f"{r['ppl_delta_vs_bf16_pct']:+.3f} % | {r['top1_vs_bf16']:.4f} | {bar} | "
                     f"{'yes' if r['passes'] else 'NO'} |")
    lines += ["", f"Served through `shardline up --dtype <scheme>`, one streamed greedy chat completion of "
              f"\"{QUESTION}\":", "", "| checkpoint | dtype | ready in (s) | chunks | text |", "|---|---|---|---|---|"]
    for preset, s in payload["served"].items():
        text = s.get("text", s.get("error", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {preset} | {SCHEMES[preset]} | {s.get('ready_s', '-')} | {s.get('chunks', '-')} | {text} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/shardline-bench"))
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--name", default="compressed-tensors")
    args = parser.parse_args(argv)
    cache = args.cache.expanduser().resolve()
    source = smollm2_dir()
    checkpoints, made = {}, {}
    for preset in SCHEMES:
        out, seconds = llm_compressor_checkpoint(cache, source, preset)
        checkpoints[preset] = out
        made[preset] = {"path": str(out), "seconds": seconds,
                        "format": compressed_format(json.loads((out / "config.json").read_text())).describe()}
    payload = {"machine": machine(), "llmcompressor": LLMCOMPRESSOR_VERSION, "checkpoints": made,
               "gate": gate(source, checkpoints, chunks=args.chunks, chunk_tokens=args.chunk_tokens), "served": {}}
    for preset, path in checkpoints.items():
        try:
            payload["served"][preset] = serve_once(path, SCHEMES[preset], cache / "shardline" / path.name)
        except Exception as exc:  # noqa: BLE001 - reported in the results
            payload["served"][preset] = {"error": f"{type(exc).__name__}: {exc}"[-500:]}
    return publish_results(args.name, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
