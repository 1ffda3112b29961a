"""Prefix-heavy serving benchmark: shardline with prefix caching, shardline without it, vLLM's CPU
build (prefix caching on, its default) and llama.cpp's ``llama-server`` (its per-slot prompt
cache), one at a time, all measured by ``vllm bench serve --dataset-name prefix_repetition``.

``python -m bench.prefix_serving [--cache ~/.cache/shardline-bench] [--rounds 1]
[--servers shardline,shardline-nocache,vllm,llama.cpp] [--prefix-len 1024] [--suffix-len 128]
[--num-prefixes 4] [--output-len 64] [--prompts-c1 32] [--prompts-c8 32] [--name serving-prefix]``

The workload: ``--num-prefixes`` shared prefixes of ``--prefix-len`` random tokens, each request
one of them plus ``--suffix-len`` tokens of its own, ``--output-len`` tokens out (``--ignore-eos``,
temperature 0), at concurrency 1 and 8. Each prefix's first request finds nothing cached: with 4
prefixes, 8 prompts would make half the requests misses and the median TTFT the mean of a miss
and a hit, so both concurrencies send 32 (28 hits); the p99 TTFT column is a miss's. Each concurrency draws
its own prefixes and suffixes (seed + concurrency): with one seed the c=8 phase re-sent the c=1
phase's 32 prompts whole, every one a full hit on a server that caches. The peers
come from ``bench.serving``'s set-up (the same ``--cache``). Writes ``bench/results/<name>.{json,md,png}``: per server and concurrency the
medians across rounds of TTFT, TPOT and output tok/s, and the ratios the prefix-caching work is
judged by (our median TTFT with caching over ours without it and over the best peer's, our tok/s
over the best peer's).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import _chat_trace as chat
from bench import _serving_report as report
from bench import serving
from bench._peers import SERVED_NAME, Cache, Server, run_logged, shardline_server, timed_round
from bench.serving import RESULTS, machine_line, warm_up
from bench.soak import REPO
from services.cli.up import resolve_model

SERVERS = ("shardline", "shardline-nocache", "vllm", "llama.cpp")
PEERS = ("vllm", "llama.cpp")


def make_server(name: str, dtype: str, cache: Cache, model_dir: Path) -> Server:
    """``bench.serving``'s servers, and ``shardline up --no-prefix-caching`` on shardline's port."""
    if name != "shardline-nocache":
        return serving.make_server(name, dtype, cache, model_dir)
    server = shardline_server(model_dir, dtype, serving.PORTS["shardline"], cache.root / name / dtype)
    server.argv.append("--no-prefix-caching")
    server.name = name
    return server


def bench_argv(cache: Cache, server: Server, model_dir: Path, concurrency: int, prompts: int,
               args: argparse.Namespace, result_dir: Path, filename: str) -> list[str]:
    return [str(cache.vllm_cli), "bench", "serve", "--backend", "vllm", "--base-url", server.base_url,
            "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(model_dir),
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(concurrency), "--num-prompts", str(prompts),
            "--seed", str(args.seed + concurrency),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename]


def ratios(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per concurrency: our median TTFT over ours without caching and over the lowest peer's
    (below 1 is faster), our output tok/s over the highest peer's (above 1 is faster)."""
    def figure(server: str, c: str, name: str) -> float | None:
        return summary.get(server, {}).get(c, {}).get(name)

    out: dict[str, Any] = {}
    for c in sorted({c for rows in summary.values() for c in rows}):
        ours, nocache = figure("shardline", c, "median_ttft_ms"), figure("shardline-nocache", c, "median_ttft_ms")
        peer_ttft = {p: figure(p, c, "median_ttft_ms") for p in PEERS if figure(p, c, "median_ttft_ms")}
        peer_rate = {p: figure(p, c, "output_tok_s") for p in PEERS if figure(p, c, "output_tok_s")}
        best_ttft = min(peer_ttft, key=peer_ttft.get, default=None)
        best_rate = max(peer_rate, key=peer_rate.get, default=None)
        rate = figure("shardline", c, "output_tok_s")
        out[c] = {
            "ttft_vs_no_cache": round(ours / nocache, 3) if ours and nocache else None,
            "ttft_vs_best_peer": round(ours / peer_ttft[best_ttft], 3) if ours and best_ttft else None,
            "ttft_best_peer": best_ttft,
            "tok_s_vs_best_peer": round(rate / peer_rate[best_rate], 3) if rate and best_rate else None,
            "tok_s_best_peer": best_rate,
        }
    return out


def chat_summary(chats: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per server, the medians across rounds of the chat trace's figures; our median TTFT over
    ours without caching and over the best peer's."""
    out: dict[str, Any] = {}
    for server, rounds in chats.items():
        def median(name: str, rounds=rounds) -> float | None:
            values = [r[name] for r in rounds if r.get(name) is not None]
            return round(statistics.median(values), 2) if values else None

        out[server] = {"median_ttft_ms": median("median_ttft_ms"), "output_chunks_per_s": median("output_chunks_per_s"),
                       "median_ttft_ms_by_turn": rounds[0]["median_ttft_ms_by_turn"],
                       "failed": sum(r["failed"] for r in rounds)}
    ours, nocache = (out.get(s, {}).get("median_ttft_ms") for s in ("shardline", "shardline-nocache"))
    peers = {p: out[p]["median_ttft_ms"] for p in PEERS if out.get(p, {}).get("median_ttft_ms")}
    best = min(peers, key=peers.get, default=None)
    out["ratios"] = {"ttft_vs_no_cache": round(ours / nocache, 3) if ours and nocache else None,
                     "ttft_vs_best_peer": round(ours / peers[best], 3) if ours and best else None,
                     "ttft_best_peer": best}
    return out


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"# Prefix-heavy serving: {result['name']}", "", f"Machine: {result['machine']}", "",
             (f"`vllm bench serve --dataset-name prefix_repetition`: {cfg['num_prefixes']} shared prefixes of "
              f"{cfg['prefix_len']} tokens, {cfg['suffix_len']}-token suffixes, {cfg['output_len']} tokens out, "
              f"{cfg['dtype']}, medians of {cfg['rounds']} round(s), one server at a time."), "",
             "| server | c | median TTFT ms | p99 TTFT ms | p99 ITL ms | median TPOT ms | output tok/s | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for server, rows in result["summary"].items():
        for c, row in rows.items():
            lines.append(f"| {server} | {c[1:]} | {report._cell(row['median_ttft_ms'])} | "
                         f"{report._cell(row.get('p99_ttft_ms'))} | {report._cell(row['p99_itl_ms'])} | {report._cell(row['median_tpot_ms'])} | "
                         f"{report._cell(row['output_tok_s'])} | {row['failed']} |")
    lines += ["", "| c | our TTFT / ours without caching | our TTFT / best peer's | our tok/s / best peer's |",
              "|---|---|---|---|"]
    for c, r in result["ratios"].items():
        lines.append(f"| {c[1:]} | {report._cell(r['ttft_vs_no_cache'], 3)} | "
                     f"{report._cell(r['ttft_vs_best_peer'], 3)} ({r['ttft_best_peer']}) | "
                     f"{report._cell(r['tok_s_vs_best_peer'], 3)} ({r['tok_s_best_peer']}) |")
    chats = result.get("chat") or {}
    if len(chats) > 1:
        lines += ["", "Multi-turn chat trace (every turn re-sends the history; `bench/_chat_trace.py`):", "",
                  "| server | median TTFT ms | median TTFT by turn, ms | output chunks/s | failed |",
                  "|---|---|---|---|---|"]
        for server, row in chats.items():
            if server != "ratios":
                lines.append(f"| {server} | {report._cell(row['median_ttft_ms'])} | {row['median_ttft_ms_by_turn']} | "
                             f"{report._cell(row['output_chunks_per_s'])} | {row['failed']} |")
        r = chats["ratios"]
        lines += ["", f"Chat: our median TTFT / ours without caching **{report._cell(r['ttft_vs_no_cache'], 3)}**, / "
                      f"best peer's ({r['ttft_best_peer']}) **{report._cell(r['ttft_vs_best_peer'], 3)}**."]
    if result["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in result["errors"]]]
    lines += ["", "Commands:", "", "```", *result["commands"], "```", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    """Bars of median TTFT and output tok/s per server and concurrency; False without matplotlib."""
    plt = report.pyplot()
    if plt is None:
        return False

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    servers = list(result["summary"])
    for ax, name, title in ((axes[0], "median_ttft_ms", "median TTFT (ms, lower is better)"),
                            (axes[1], "output_tok_s", "output tok/s (higher is better)")):
        cs = sorted({c for rows in result["summary"].values() for c in rows}, key=lambda c: int(c[1:]))
        width = 0.8 / max(1, len(servers))
        for i, server in enumerate(servers):
            values = [result["summary"][server].get(c, {}).get(name) or 0 for c in cs]
            ax.bar([j + i * width for j in range(len(cs))], values, width, label=server)
        ax.set_xticks([j + width * (len(servers) - 1) / 2 for j in range(len(cs))], [f"c={c[1:]}" for c in cs])
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"prefix-heavy traffic, {result['machine'].split(',')[0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/shardline-bench"))
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-c1", type=int, default=32)
    parser.add_argument("--prompts-c8", type=int, default=32)
    parser.add_argument("--chat-conversations", type=int, default=8, help="multi-turn chat trace (0: none)")
    parser.add_argument("--chat-turns", type=int, default=6)
    parser.add_argument("--chat-concurrency", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0,
                        help="the dataset's seed (default 0); concurrency c draws its prompts with seed + c")
    parser.add_argument("--name", default="serving-prefix")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="go on with an interrupted run: what its result files and chat.json hold is kept")
    args = parser.parse_args(argv)
    args.cache = args.cache.expanduser().resolve()
    args.servers = [s for s in args.servers.split(",") if s]
    if set(args.servers) - set(SERVERS):
        parser.error(f"--servers: unknown {', '.join(sorted(set(args.servers) - set(SERVERS)))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, line = time.monotonic(), machine_line()
    os.chdir(REPO)
    model_dir = resolve_model("smollm2")
    cache = Cache(args.cache)
    cache.setup(model_dir, llama="llama.cpp" in args.servers)
    run_dir = args.resume or cache.root / "runs" / f"{args.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=args.resume is not None)
    chat_file = run_dir / "chat.json"
    commands: dict[str, str] = {}
    errors: list[str] = []
    chats: dict[str, list[dict[str, Any]]] = json.loads(chat_file.read_text()) if chat_file.exists() else {}
    for round_ in range(args.rounds):
        for name in args.servers if round_ % 2 == 0 else args.servers[::-1]:
            chat_done = not args.chat_conversations or len(chats.get(name, ())) > round_
            if chat_done and all((run_dir / report.result_name(name, c, round_)).exists() for c in (1, 8)):
                continue  # done in the run resumed
            server = make_server(name, args.dtype, cache, model_dir)
            commands.setdefault(f"{name} server", shlex.join(server.argv))
            print(f"round {round_ + 1}/{args.rounds}: {name} ...", flush=True)

            def body(_started: float, name: str = name, server: Server = server, round_: int = round_,
                     chat_done: bool = chat_done) -> None:
                warm_up(server)
                for concurrency, n in ((1, args.prompts_c1), (8, args.prompts_c8)):
                    if (run_dir / report.result_name(name, concurrency, round_)).exists():
                        continue
                    argv_ = bench_argv(cache, server, model_dir, concurrency, n, args, run_dir,
                                       report.result_name(name, concurrency, round_))
                    commands.setdefault(f"{name} bench c={concurrency}", shlex.join(argv_))
                    run_logged(argv_, cache.logs / f"bench-{run_dir.name}.log", env=cache.vllm_env())
                if not chat_done:
                    trace = chat.ChatTrace(conversations=args.chat_conversations, turns=args.chat_turns,
                                           concurrency=args.chat_concurrency, seed=args.seed + round_)
                    chats.setdefault(name, []).append(chat.run(server.base_url, SERVED_NAME, trace))
                    chat_file.write_text(json.dumps(chats))
                    print(f"  chat trace: {chats[name][-1]}", flush=True)

            timed_round(server, f"round {round_}, {name}", errors, body)
    runs = report.summarize(report.load_runs(run_dir), args.output_len)
    summary = {name: runs[name] for name in args.servers if name in runs}
    result = {"name": args.name, "machine": line,
              "config": {k: getattr(args, k) for k in ("dtype", "rounds", "prefix_len", "suffix_len", "num_prefixes",
                                                       "output_len", "prompts_c1", "prompts_c8", "seed")},
              "servers": args.servers, "summary": summary, "ratios": ratios(summary), "chat": chat_summary(chats),
              "errors": errors,
              "run_s": round(time.monotonic() - started, 1), "raw_results": str(run_dir),
              "commands": [f"python -m bench.prefix_serving {shlex.join(argv if argv is not None else sys.argv[1:])}",
                           *(f"# {k}\n{v}" for k, v in commands.items())]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.name}.md").write_text(markdown(result))
    plot(result, RESULTS / f"{args.name}.png")
    print(markdown(result), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
