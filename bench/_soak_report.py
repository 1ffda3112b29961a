"""The soak bench's verdict, its markdown note and its RSS plot (from the result dict alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A process "grows" when its last-window mean RSS exceeds its first-window mean by both of these.
GROWTH_MB = 16.0
GROWTH_PCT = 10.0


def verdict(r: dict[str, Any]) -> dict[str, Any]:
    """Pass/fail of the correctness checks, and RSS flatness reported beside them (a short run's
    first window is warm-up, so RSS does not decide ``pass``)."""
    outcomes = r["requests"]["by_outcome"]
    growing = [g["label"] for g in r["rss"]["growth"]
               if g["growth_mb"] is not None and g["growth_mb"] > GROWTH_MB and (g["growth_pct"] or 0) > GROWTH_PCT]
    checks = {
        "no_5xx": r["status_5xx"] == 0,
        "no_unexpected_stream_errors": r["unexpected_stream_errors"] == 0,
        "malformed_all_expected_4xx": outcomes.get("malformed_unexpected", 0) == 0
        and outcomes.get("malformed_connection_error", 0) == 0,
        "no_connection_errors": outcomes.get("connection_error", 0) == 0,
        "no_client_bugs": outcomes.get("client_bug", 0) == 0,
        "stack_alive_at_end": bool(r.get("stack_alive_at_end", True)),
        "workers_drained": bool(r.get("workers_after_load")) and all(
            w.get("drained") for w in r["workers_after_load"].values()),
        "served_streams": outcomes.get("completed", 0) > 0,
    }
    return {**checks, "pass": all(checks.values()), "rss_flat": not growing, "rss_growing": growing}


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "–" if x is None else f"{x:{fmt}}"


def markdown(r: dict[str, Any], plotted: bool) -> str:
    c, m, v = r["config"], r["machine"], r["verdict"]
    gap, ttft = r["inter_token_gap_ms"], r["ttft_ms"]
    outcomes = r["requests"]["by_outcome"]
    lines = [
        "# Soak bench",
        "",
        f"`python -m bench.soak --model {c['model']} --streams {c['streams']} --duration {c['duration_s']:g} "
        f"--malformed-share {c['malformed_share']:g} --cancel-share {c['cancel_share']:g}`: the stack started as "
        f"`{c['command']}` ({c['replicas']} replica group(s), model `{c['served_model']}`; healthy after "
        f"{r['startup_s']:.1f} s), then {c['streams']} client loops for {r['load_s']:.0f} s through the OpenAI "
        f"HTTP API. Each request is malformed with probability {c['malformed_share']:g} (`httpx`), a stream the "
        f"client closes after a random number of tokens with {c['cancel_share']:g}, else a normal streamed "
        f"completion or chat of 16–96 tokens (`openai` client). Machine: {m['cpus']} CPUs, {m['platform']}; "
        f"the clients share it with the stack (client CPU {r['client_cpu_s']:.0f} s; 1-minute load average "
        f"{m['load_avg_1m_before']:.1f} before, {m['load_avg_1m_after']:.1f} after).",
        "",
        "## Verdict",
        "",
        f"- 5xx responses: **{r['status_5xx']}** ({'pass' if v['no_5xx'] else 'FAIL'})",
        f"- unexpected stream errors (error event, cut without finish_reason, broken transport): "
        f"**{r['unexpected_stream_errors']}** ({'pass' if v['no_unexpected_stream_errors'] else 'FAIL'})",
        f"- malformed requests answered with their expected 4xx and an OpenAI error body: "
        f"{outcomes.get('malformed_rejected', 0)} of "
        f"{outcomes.get('malformed_rejected', 0) + outcomes.get('malformed_unexpected', 0)} "
        f"({'pass' if v['malformed_all_expected_4xx'] else 'FAIL'})",
        f"- stack alive at the end: {'yes' if v['stack_alive_at_end'] else 'NO'}; `shardline up` exit code after "
        f"SIGTERM: {r['stack_exit_code']}",
        f"- RSS growth per process, mean of the first {r['rss']['window_s']:g} s of load vs the last "
        f"{r['rss']['window_s']:g} s: " + ", ".join(
            f"{g['label']} {_f(g['growth_mb'], '+.1f')} MiB ({_f(g['growth_pct'], '+.1f')} %)"
            for g in r["rss"]["growth"]),
        f"- RSS: {'flat' if v['rss_flat'] else 'GROWS in ' + ', '.join(v['rss_growing'])} (a process grows when "
        f"both +{GROWTH_MB:g} MiB and +{GROWTH_PCT:g} %)",
        "- workers after the load (queues and KV blocks must be empty once the clients are gone): " + ", ".join(
            f"{name} running {w.get('running')}, waiting {w.get('waiting')}, KV blocks {w.get('blocks_used')}"
            + ("" if w.get("drained") else " NOT DRAINED") for name, w in r.get("workers_after_load", {}).items()),
        f"- overall: **{'pass' if v['pass'] else 'FAIL'}**",
        "",
        "## Requests",
        "",
        f"{r['requests']['total']:,} requests ({r['requests_per_s']:.1f}/s), {r['tokens']:,} completion tokens "
        f"streamed ({r['tokens_per_s']:,.1f} tokens/s).",
        "",
        "| outcome | requests |",
        "|---|---|",
        *(f"| {k} | {n:,} |" for k, n in outcomes.items()),
        "",
        "| malformed kind | expected | got |",
        "|---|---|---|",
        *(f"| {kind} | {x['expected']} | " + (", ".join(f"{s}: {n}" for s, n in sorted(x['by_status'].items()))
                                               or "not drawn") + " |"
          for kind, x in r["malformed"].items()),
        "",
    ]
    if r["errors_by_class"]:
        lines += ["| error class | count | first message |", "|---|---|---|"]
        lines += [f"| {cls} | {n} | {r['error_samples'].get(cls, [''])[0][:160].replace('|', '/')} |"
                  for cls, n in r["errors_by_class"].items()]
        lines.append("")
    else:
        lines += ["No errors of any class.", ""]
    lines += [
        "## Latency of the normal streams",
        "",
        "| measure | p50 | p99 | max | samples |",
        "|---|---|---|---|---|",
        f"| inter-token gap | {_f(gap['p50'], '.1f')} ms | {_f(gap['p99'], '.1f')} ms | {_f(gap['max'], '.1f')} ms "
        f"| {gap['count']:,} |",
        f"| time to first token | {_f(ttft['p50'], '.0f')} ms | {_f(ttft['p99'], '.0f')} ms | "
        f"{_f(ttft['max'], '.0f')} ms | {ttft['count']:,} |",
        "",
        "## Over time",
        "",
        "| from (s) | requests | completed | tokens/s | gap p50 | gap p99 | gap max |",
        "|---|---|---|---|---|---|---|",
        *(f"| {b['t_s']:g} | {sum(b['outcomes'].values()):,} | {b['outcomes'].get('completed', 0):,} | "
          f"{b['tokens_per_s']:,.0f} | {_f(b['inter_token_gap_ms']['p50'])} ms | "
          f"{_f(b['inter_token_gap_ms']['p99'])} ms | {_f(b['inter_token_gap_ms']['max'])} ms |"
          for b in r["over_time"]),
        "",
        "## RSS per process",
        "",
        f"Sampled every {c['sample_interval_s']:g} s from the process tree under the `shardline up` pid "
        f"({'psutil' if m['psutil'] else '/proc'}).",
        "",
        "| process | pid | first window | last window | growth | peak |",
        "|---|---|---|---|---|---|",
        *(f"| {g['label']} | {g['pid']} | {_f(g['first_mb'])} MiB | {_f(g['last_mb'])} MiB | "
          f"{_f(g['growth_mb'], '+.1f')} MiB ({_f(g['growth_pct'], '+.1f')} %) | {g['peak_mb']:.1f} MiB |"
          for g in r["rss"]["growth"]),
        "",
    ]
    if plotted:
        lines += ["![RSS of each process over time](soak-rss.png)", ""]
    else:
        lines += ["(No plot: matplotlib is not installed; `pip install -e '.[bench]'`.)", ""]
    return "\n".join(lines)


def plot_rss(r: dict[str, Any], path: Path) -> bool:
    """RSS of every process over time, the load window shaded; False without matplotlib."""
    try:
        import matplotlib  # deferred: an optional dependency (the bench extra), only for the plot
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (ax, delta) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for s in r["rss"]["processes"]:
        if s["samples"]:
            ts, mbs = zip(*s["samples"])
            line, = ax.plot(ts, mbs, label=f"{s['label']} ({s['pid']})", linewidth=1.2)
            delta.plot(ts, [mb - mbs[0] for mb in mbs], color=line.get_color(), linewidth=1.2)
    for a in (ax, delta):
        a.axvspan(r["rss"]["load_start_s"], r["rss"]["load_end_s"], color="0.93", zorder=0)
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("RSS (MiB, log scale)")
    delta.set_ylabel("RSS − first sample (MiB)")
    delta.set_xlabel("seconds since the stack was healthy (shaded: the load)")
    c = r["config"]
    ax.set_title(f"shardline soak: {c['streams']} streams, {c['served_model']}, {r['load_s']:.0f} s")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
