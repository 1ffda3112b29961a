"""Two checkouts of shardline served side by side, paired: is a change faster or slower?

``git worktree add /tmp/before <commit>`` then, from this checkout:
``python -m bench.checkout_pairs /tmp/before [--model smollm2] [--dtype bfloat16] [--isa native] [--pairs 24]
[--bursts 6] [--name checkout-pairs]``

Each checkout serves the model with ``shardline up`` from its own tree (its own kernels build),
both up at once. At c=1, single streamed requests alternate between the two (the order flips pair
by pair); at c=16, bursts of 16 concurrent requests alternate the same way. Each figure is the
median over pairs (or bursts) of after / before, so the VM's memory rate, which moves by tens of
percent from minute to minute, lands on both sides of each ratio: TPOT at c=1; output tok/s,
median TPOT and median TTFT of a burst at c=16. 128 prompt tokens drawn at random, 64 out,
temperature 0, ``ignore_eos``. Writes ``bench/results/NAME.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from bench._peers import Server, hold_to_isa, shardline_server
from bench.common import machine, publish_results
from bench.decode_pairs import prompts, stream_tpot
from bench.serving import MODELS, model_dir_for
from bench.soak import REPO

PORTS = {"before": 18_800, "after": 18_810}  # each stack takes port..port+4


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def burst(server: Server, batch: list[list[int]], max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        out = list(pool.map(lambda p: stream_tpot(server, p, max_tokens), batch))
    return {"tok_s": len(batch) * max_tokens / (time.perf_counter() - t0),
            "tpot_s": statistics.median(o["tpot_s"] for o in out),
            "ttft_s": statistics.median(o["ttft_s"] for o in out)}


def markdown(payload: dict) -> str:
    lines = [f"# Two checkouts paired (`{payload['name']}`)", "",
             f"Before `{payload['commits']['before']}`, after `{payload['commits']['after']}`; "
             f"{payload['config']['model']} {payload['config'].get('dtype', 'bfloat16')}, "
             f"kernels for {payload['config'].get('isa', 'native')}, "
             f"{payload['config']['pairs']} pairs at c=1, "
             f"{payload['config']['bursts']} bursts of 16 at c=16, order alternating. Machine: {payload['machine']}. "
             f"Command: `{payload['command']}`.", "",
             "| figure | before | after | after / before (median of the pairs' ratios) |", "|---|---|---|---|"]
    for key, row in payload["summary"].items():
        scale, unit = (1e3, " ms") if key.endswith("_s") and "tok" not in key else (1.0, "")
        lines.append(f"| {key} | {row['before'] * scale:.2f}{unit} | {row['after'] * scale:.2f}{unit} | "
                     f"**{row['after_over_before']:.3f}** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkout_pairs", description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="the other checkout (a git worktree of the commit to compare)")
    parser.add_argument("--model", default="smollm2", choices=MODELS)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "int8", "fp8"),
                        help="what `up --dtype` serves (int8, fp8: quantized at load from the bf16 weights)")
    parser.add_argument("--isa", default="native", choices=("native", "avx2"),
                        help="avx2: both servers' kernels built for AVX2 + FMA (an AVX2-only machine's stand-in)")
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--name", default="checkout-pairs")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    hold_to_isa(args.isa)
    model_dir = model_dir_for(args.model)
    trees = {"before": args.before.resolve(), "after": REPO}
    work = Path("/tmp") / f"shardline-{args.name}"
    servers = {k: shardline_server(model_dir, args.dtype, PORTS[k], work / k, tree=tree) for k, tree in trees.items()}
    batch = prompts(Tokenizer.from_file(str(model_dir / "tokenizer.json")), max(args.pairs, 48), 128, 1)
    runs: dict[str, dict[str, list[float]]] = {k: {"c1_tpot_s": [], "c16_tok_s": [], "c16_tpot_s": [],
                                                   "c16_ttft_s": []} for k in servers}
    try:
        for server in servers.values():
            server.start()
            stream_tpot(server, batch[0], 8)
        for i in range(args.pairs):
            for k in (("before", "after") if i % 2 == 0 else ("after", "before")):
                runs[k]["c1_tpot_s"].append(stream_tpot(servers[k], batch[i], 64)["tpot_s"])
        for i in range(args.bursts):
            for k in (("before", "after") if i % 2 == 0 else ("after", "before")):
                got = burst(servers[k], batch[16 * (i % 3):16 * (i % 3) + 16], 64)
                for key in ("tok_s", "tpot_s", "ttft_s"):
                    runs[k][f"c16_{key}"].append(got[key])
            print(f"burst {i}: " + ", ".join(f"{k} {runs[k]['c16_tok_s'][-1]:.0f} tok/s" for k in servers), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    summary = {key: {"before": statistics.median(runs["before"][key]), "after": statistics.median(runs["after"][key]),
                     "after_over_before": statistics.median(a / b for a, b in zip(runs["after"][key],
                                                                                   runs["before"][key], strict=True))}
               for key in runs["before"]}
    payload = {"name": args.name, "machine": machine(), "commits": {k: commit_of(t) for k, t in trees.items()},
               "command": "python -m bench.checkout_pairs " + " ".join(argv if argv is not None else sys.argv[1:]),
               "config": {"model": args.model, "dtype": args.dtype, "isa": args.isa, "pairs": args.pairs,
                          "bursts": args.bursts},
               "summary": summary,
               "runs": runs}
    return publish_results(args.name, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
