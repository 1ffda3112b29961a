"""The pure half of ``bench.serving``: ``vllm bench serve`` result files into the summary, the
ratios against the best peer, the greedy agreement, the Markdown note and the plot."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

OURS = "shardline"
# our name -> the key in a `vllm bench serve --save-result` file
METRICS = {"output_tok_s": "output_throughput", "median_tpot_ms": "median_tpot_ms", "p99_tpot_ms": "p99_tpot_ms",
           "median_ttft_ms": "median_ttft_ms", "p99_ttft_ms": "p99_ttft_ms", "p99_itl_ms": "p99_itl_ms"}
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct",
               "1b-class": "a 1B-class Llama shape with random weights (16 layers, hidden 2048, 32 / 8 heads, "
                           "intermediate 8192, SmolLM2's vocabulary: 1.17B parameters)"}
RESULT_NAME = re.compile(r"^(?P<server>.+)_c(?P<c>\d+)_r(?P<round>\d+)\.json$")


def result_name(server: str, concurrency: int, round_: int) -> str:
    return f"{server}_c{concurrency}_r{round_}.json"


def run_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """One bench run's figures. ``failed`` is the file's own count where it has one, else the
    prompts sent less those completed."""
    out: dict[str, Any] = {name: raw.get(key) for name, key in METRICS.items()}
    completed = int(raw.get("completed", 0))
    failed = raw.get("failed")
    if failed is None:
        failed = int(raw.get("num_prompts", completed)) - completed
    out.update(completed=completed, failed=int(failed), output_tokens=int(raw.get("total_output_tokens", 0)))
    return out


def load_runs(result_dir: Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """server -> concurrency -> one figures dict per round (in round order), from the files
    named by :func:`result_name` in ``result_dir``."""
    found: list[tuple[str, int, int, dict[str, Any]]] = []
    for path in sorted(result_dir.glob("*.json")):
        match = RESULT_NAME.match(path.name)
        if match:
            found.append((match["server"], int(match["c"]), int(match["round"]),
                          run_figures(json.loads(path.read_text()))))
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for server, c, _round, figures in sorted(found, key=lambda f: (f[0], f[1], f[2])):
        runs.setdefault(server, {}).setdefault(c, []).append(figures)
    return runs


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def summarize(runs: dict[str, dict[int, list[dict[str, Any]]]],
              output_len: int | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Per server and concurrency (``"c1"``, ``"c16"``): the median across rounds of each metric,
    the failed requests summed over the rounds, and how many rounds there were. With
    ``output_len`` (every request generates that many: ``--ignore-eos``), ``tokens_counted`` is
    the share of them the client counted: it takes the count from a ``usage`` chunk without
    choices, else re-tokenizes the streamed text, which can come out shorter (llama-server puts
    ``usage`` on its last chunk with choices); its tok/s and TPOT are computed on that count."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for server, by_c in runs.items():
        for c, rounds in sorted(by_c.items()):
            row: dict[str, Any] = {name: _median([r[name] for r in rounds]) for name in METRICS}
            row["failed"] = sum(r["failed"] for r in rounds)
            row["completed"] = sum(r["completed"] for r in rounds)
            row["rounds"] = len(rounds)
            if output_len and row["completed"]:
                row["tokens_counted"] = round(sum(r["output_tokens"] for r in rounds)
                                              / (row["completed"] * output_len), 4)
            out.setdefault(server, {})[f"c{c}"] = row
    return out


# ratio name -> (concurrency, metric, whether lower is better): ours over the best peer's
RATIOS = {"tpot_c1": ("c1", "median_tpot_ms", True), "tok_s_c16": ("c16", "output_tok_s", False),
          "ttft_c16": ("c16", "median_ttft_ms", True), "p99_tpot_c16": ("c16", "p99_tpot_ms", True),
          "tok_s_c64": ("c64", "output_tok_s", False)}


def ratios(summary: dict[str, dict[str, dict[str, Any]]], ours: str = OURS) -> dict[str, Any]:
    """``<name>_vs_best_peer`` for each of RATIOS: our figure over the best peer's (the lowest
    TPOT or TTFT, the highest tok/s), and ``<name>_best_peer`` naming it. Below 1 is better for
    times, above 1 for tok/s. None where we or every peer lack the figure."""
    def figure(server: str, c: str, name: str) -> float | None:
        return summary.get(server, {}).get(c, {}).get(name)

    peers = [s for s in summary if s != ours]
    out: dict[str, Any] = {}
    for name, (c, metric, lower) in RATIOS.items():
        values = {p: v for p in peers if (v := figure(p, c, metric))}
        best = (min if lower else max)(values, key=values.__getitem__) if values else None
        mine = figure(ours, c, metric)
        out[f"{name}_vs_best_peer"] = round(mine / values[best], 3) if mine and best else None
        out[f"{name}_best_peer"] = best
    return out


def common_prefix(a: list[int] | str, b: list[int] | str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(texts: dict[str, list[str]], encode, ours: str = OURS) -> dict[str, Any]:
    """Greedy texts per server (one per prompt) against ours: per peer and prompt, the matching
    prefix in tokens (each text encoded with the model's tokenizer, ``encode``) and in
    characters, and whether the whole texts are equal."""
    out: dict[str, Any] = {}
    reference = texts.get(ours)
    if reference is None:
        return out
    ours_ids = [encode(t) for t in reference]
    for peer, peer_texts in texts.items():
        if peer == ours:
            continue
        rows = []
        for i, (mine, theirs) in enumerate(zip(reference, peer_texts)):
            theirs_ids = encode(theirs)
            rows.append({"prompt": i, "prefix_tokens": common_prefix(ours_ids[i], theirs_ids),
                         "tokens": max(len(ours_ids[i]), len(theirs_ids)), "prefix_chars": common_prefix(mine, theirs),
                         "equal": mine == theirs})
        out[peer] = {"all_equal": all(r["equal"] for r in rows), "prompts": rows}
    return out


# ---- the note and the plot ------------------------------------------------------------------

def _cell(value: Any, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


# what a run held to fewer instructions than the machine has says of itself (bench.serving --isa)
ISA_LINES = {"avx2": ["Every server held to **AVX2 + FMA** (no AVX-512), an AVX2-only machine's stand-in: shardline's "
                      "kernels built for `x86-64-v3`, torch and oneDNN held to AVX2 (`ATEN_CPU_CAPABILITY`, "
                      "`ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`), llama.cpp built with `GGML_NATIVE=OFF` and "
                      "AVX2/FMA/F16C only. vLLM's own C++ kernels pick their instruction set at build time, not "
                      "from these variables.", ""]}


def markdown(result: dict[str, Any]) -> str:
    cfg, summary, rat = result["config"], result["summary"], result["ratios"]
    lines = [f"# Serving: shardline vs vLLM (CPU) vs llama.cpp, `vllm bench serve` (`{result['name']}`)", "",
             f"Machine: {result['machine']['line']}", "",
             *ISA_LINES.get(cfg.get("isa", "native"), []),
             f"{MODEL_NAMES[cfg.get('model', 'smollm2')]}, {cfg['dtype']}; random dataset, {cfg['input_len']} input / "
             f"{cfg['output_len']} output tokens, `--ignore-eos`, temperature 0; {cfg['rounds']} round(s), "
             f"server order alternating, one server running at a time; medians across rounds "
             f"(failed: summed).", "",
             "| server | concurrency | prompts | output tok/s | median TPOT ms | p99 TPOT ms | median TTFT ms "
             "| p99 ITL ms | failed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for server in result["servers"]:
        for c in ("c1", "c16", "c64"):
            row = summary.get(server, {}).get(c)
            if row is None:
                continue
            prompts = cfg["prompts"].get(c)
            lines.append(f"| {server} | {c[1:]} | {prompts} | {_cell(row['output_tok_s'])} | "
                         f"{_cell(row['median_tpot_ms'], 2)} | {_cell(row['p99_tpot_ms'], 2)} | "
                         f"{_cell(row['median_ttft_ms'], 1)} | {_cell(row['p99_itl_ms'], 2)} | {row['failed']} |")
    what = {"tpot_c1": "median TPOT at c=1; below 1 is faster", "tok_s_c16": "output tok/s at c=16; above 1 is faster",
            "ttft_c16": "median TTFT at c=16; below 1 is sooner", "p99_tpot_c16": "p99 TPOT at c=16; below 1 is faster",
            "tok_s_c64": "output tok/s at c=64; above 1 is faster"}
    lines.append("")
    lines += [f"- `{name}_vs_best_peer` = **{_cell(rat.get(f'{name}_vs_best_peer'), 3)}** "
              f"(ours / {rat.get(f'{name}_best_peer') or 'no peer'}'s {what[name]})" for name in RATIOS
              if name != "tok_s_c64" or "c64" in cfg["prompts"] and cfg["prompts"]["c64"]]
    lines.append("")
    for error in result.get("errors", []):
        lines.append(f"- error: {error.splitlines()[0][:300]}")
    undercounted = [f"- {server} at {c}: the client counted {row['tokens_counted']:.1%} of the "
                    f"{cfg['output_len']} tokens per request (no `usage` chunk of its own: it re-tokenized the text), "
                    f"so its tok/s reads low and its TPOT high by about {1 / row['tokens_counted'] - 1:.1%}"
                    for server in result["servers"] for c, row in summary.get(server, {}).items()
                    if row.get("tokens_counted") is not None and row["tokens_counted"] < 0.999]
    lines += [*undercounted, ""] if undercounted else []
    starts = result.get("startup_s", {})
    if starts:
        lines += ["Startup (seconds until `/health` answered 200, median): "
                  + ", ".join(f"{s} {statistics.median(v):.0f}" for s, v in starts.items() if v), ""]
    agree = result.get("agreement")
    if agree:
        lines += [f"## Greedy agreement (float32, {agree['max_tokens']} tokens, matching prefix vs shardline)", ""]
        for peer, rows in agree.get("peers", {}).items():
            cells = ", ".join(f"{r['prefix_tokens']}/{r['tokens']}" for r in rows["prompts"])
            lines.append(f"- {peer}: {cells} tokens{' (all equal)' if rows['all_equal'] else ''}")
        for error in agree.get("errors", []):
            lines.append(f"- error: {error}")
        lines.append("")
    lines += ["## Commands", "", "```", *result["commands"], "```", ""]
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files, or None without matplotlib."""
    try:  # deferred: matplotlib is the optional bench extra; without it there is no plot
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(result: dict[str, Any], path: Path) -> bool:
    """Bars of c=1 median TPOT and c=16 output tok/s per server; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False

    servers = [s for s in result["servers"] if s in result["summary"]]
    summary = result["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    colors = ["#2a6f97" if s == OURS else "#999999" for s in servers]
    for ax, c, name, title in ((left, "c1", "median_tpot_ms", "median TPOT at concurrency 1 (ms, lower is better)"),
                               (right, "c16", "output_tok_s", "output tok/s at concurrency 16 (higher is better)")):
        values = [summary[s].get(c, {}).get(name) or 0.0 for s in servers]
        bars = ax.bar(servers, values, color=colors)
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.15)
    fig.suptitle(f"vllm bench serve, {result['config'].get('model', 'smollm2')} {result['config']['dtype']}, "
                 f"{result['machine']['line']}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
