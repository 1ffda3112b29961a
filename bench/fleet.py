"""Fleet bench: the fleet controller healing, re-sharding, refusing a bad candidate and scaling, under load.

``python -m bench.fleet [--model smollm2|tiny|DIR] [--streams 8] [--out bench/results]``

One fleet, one router, one controller (``bench/_fleet_stack.py``: real processes, an SQLite
registry unless ``--registry-url``), ``--streams`` greedy streams looping through the ``openai``
client the whole time, every completion compared with its fault-free text. The scenarios, in
order, each with its own load:

1. **heal**: SIGKILL the worker process of one of two TP1 bf16 groups;
2. **re-shard**: roll the fleet to TP1 x PP2 bf16, then to TP1 x PP2 int8;
3. **bad candidate**: roll to a plan whose weights carry planted noise; the gate must refuse it;
4. **autoscale**: min 1, max 3 on KV utilization; long generations, then none.

Recorded per scenario: requests (ok, failed, differing from the fault-free text), the smallest
number of groups in rotation the router showed, the controller's events (provisioning, gates with
their figures, drains, scaling), and its duration. Writes ``fleet.json``, ``fleet.md`` and
``fleet.png`` (groups in rotation and the mean KV utilization the router saw, over time, with the
scenarios and the controller's events marked).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._fleet_stack import FleetStack, Load, RotationMonitor, driver_pid, fleet_spec
from bench.common import RESULTS, machine, smollm2_dir
from services.modeling.tiny import TinyModelSpec, write_tiny_model

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):",
           "Three facts about the moon:", "The quick brown fox", "Explain what a hash map is.",
           "Once upon a time, in a small village,", "The best way to learn a language is"]
NOISE = "layer=1,std=0.5,seed=0"


def model_dir(spec: str, workdir: Path) -> Path:
    if spec == "smollm2":
        return smollm2_dir()
    if spec == "tiny":
        out = workdir / "tiny"
        write_tiny_model(TinyModelSpec(), out)
        return out
    return Path(spec).resolve()


class Bench:
    def __init__(self, stack: FleetStack, model: Path, args: argparse.Namespace) -> None:
        self.stack, self.model, self.args = stack, model, args
        self.scenarios: list[dict[str, Any]] = []
        self.serving: dict[str, Any] = {}  # the plan in rotation (fleet_spec's overrides)
        self.expected: dict[int, str] = {}
        self.t0 = time.monotonic()
        self.monitor = RotationMonitor(stack)

    def spec(self, **overrides: Any) -> dict[str, Any]:
        return fleet_spec(self.stack.fleet, self.model, kv_cache_cap_gb=self.args.kv_cache_gb,
                          gate_chunks=self.args.gate_chunks, collective_timeout_s=self.args.collective_timeout,
                          **overrides)

    def rollout_to(self, name: str, plan: dict[str, Any]) -> None:
        """A rollout scenario; the plan serves afterwards if the gate let it through."""
        load = self.load()
        self.stack.apply(self.spec(**plan))
        result = self.scenario(name, load, self.wait_rollout)
        if result["rollout"] == "succeeded":
            self.serving = plan

    def load(self, max_tokens: int | None = None, streams: int | None = None, *, ignore_eos: bool = False) -> Load:
        return Load(self.stack.http, self.stack.fleet, PROMPTS, max_tokens or self.args.max_tokens,
                    concurrency=streams or self.args.streams, ignore_eos=ignore_eos).start()

    def scenario(self, name: str, load: Load, run: Any) -> dict[str, Any]:
        start = time.monotonic()
        first_sample = len(self.monitor.samples)
        events_before = len(self.stack.events())
        detail = run() or {}
        outcomes = load.stop()
        rotation = [n for _, n, _ in self.monitor.samples[first_sample:]]
        wrong = [o for o in outcomes if o.ok and o.prompt in self.expected and o.text != self.expected[o.prompt]]
        result = {"scenario": name, "start_s": round(start - self.t0, 1), "seconds": round(time.monotonic() - start, 1),
                  "requests": len(outcomes), "failed": sum(not o.ok for o in outcomes),
                  "errors": sorted({o.error[:120] for o in outcomes if not o.ok})[:5],
                  "differing": len(wrong), "continued": sum(len(o.groups) > 1 for o in outcomes),
                  "min_in_rotation": min(rotation) if rotation else None,
                  "max_in_rotation": max(rotation) if rotation else None,
                  "events": [e for _, e in self.stack.events()[events_before:]], **detail}
        print(f"{name}: {result['requests']} requests, {result['failed']} failed, {result['differing']} differing, "
              f"rotation {result['min_in_rotation']}..{result['max_in_rotation']}, {result['seconds']} s", flush=True)
        self.scenarios.append(result)
        return result

    def wait_rollout(self, timeout_s: float = 600) -> dict[str, Any]:
        revision = self.stack.status()["revision"]

        def ended() -> bool:
            rollout = self.stack.status()["rollout"]
            return rollout is not None and rollout["to_revision"] == revision and \
                rollout["status"] in ("succeeded", "failed")

        self.stack.wait(ended, timeout_s, "the rollout to end")
        time.sleep(2.0)
        rollout = self.stack.rollout()
        gates = [{k: e.get(k) for k in ("event", "group", "perplexity_delta_pct", "delta_interval_pct",
                                        "top1_agreement", "reasons")}
                 for e in rollout["events"] if e["event"] in ("gate-passed", "gate-failed")]
        return {"rollout": rollout["status"], "reason": rollout["reason"], "gates": gates}

    def run(self) -> None:
        stack = self.stack
        stack.start(self.spec(), groups=2, timeout_s=600)
        self.monitor.start()
        probe = Load(stack.http, stack.fleet, PROMPTS, self.args.max_tokens, concurrency=1)
        self.expected = {i: probe.one(i).text for i in range(len(PROMPTS))}

        def heal() -> dict[str, Any]:
            time.sleep(3)
            victim = sorted(g["id"] for g in stack.status()["groups"] if g["status"] == "healthy")[0]
            os.kill(driver_pid(victim), signal.SIGKILL)
            took = stack.wait(lambda: sum(g["status"] == "healthy" for g in stack.status()["groups"]) == 2
                              and victim not in {g["id"] for g in stack.status()["groups"] if g["status"] != "dead"},
                              300, "a replacement in rotation")
            time.sleep(2)
            return {"killed": victim, "healed_s": round(took, 1)}

        self.scenario("steady load (baseline)", self.load(), lambda: time.sleep(self.args.baseline_s))
        self.scenario("heal", self.load(), heal)
        self.rollout_to("re-shard to TP1 x PP2 bf16", {"pp": 2})
        self.rollout_to("re-shard to TP1 x PP2 int8", {"pp": 2, "dtype": "int8"})
        self.rollout_to("candidate with noisy weights", {**self.serving, "env": {"SHARDLINE_WEIGHT_NOISE": NOISE}})

        scaling = {"min_replicas": 1, "max_replicas": 3, "scale_out_threshold": 80, "scale_in_threshold": 35,
                   "window_s": self.args.scale_window, "cooldown_s": self.args.scale_cooldown}
        stack.apply(self.spec(**self.serving, autoscaling=scaling))  # the serving plan: no rollout
        stack.wait(lambda: stack.status()["in_rotation"] == 1, 300, "scale-in to 1 without load")

        def pressure() -> dict[str, Any]:
            stack.wait(lambda: stack.status()["in_rotation"] >= 3 or time.monotonic() - begin > self.args.hold_s,
                       self.args.hold_s + 60, "max replicas or the hold time")
            return {"peak_in_rotation": stack.status()["in_rotation"]}

        begin = time.monotonic()
        self.scenario("autoscale: load", self.load(self.args.long_tokens, self.args.long_streams, ignore_eos=True),
                      pressure)

        def quiet() -> dict[str, Any]:
            took = stack.wait(lambda: stack.status()["in_rotation"] == 1
                              and sum(g["status"] != "dead" for g in stack.status()["groups"]) == 1,
                              600, "scale-in back to 1")
            return {"scaled_in_s": round(took, 1)}

        self.scenario("autoscale: no load", self.load(streams=1), quiet)


def markdown(payload: dict[str, Any]) -> str:
    lines = [f"# Fleet controller under load ({payload['model']})", "",
             f"`python -m bench.fleet --model {payload['args']['model']}` — {payload['args']['streams']} greedy "
             f"streams through the `openai` client during every scenario, each completion compared with its "
             f"fault-free text; {payload['machine']['cpu_count']} CPUs, load before the run {payload['load_before']}.",
             "", "*differing*: completions whose text is not the first bf16 group's fault-free text (expected once "
             "int8 groups serve; none in the bf16 scenarios, whose matmuls and attention are batch-invariant on "
             "CPU). *continued*: streams that finished on another group than they started on.",
             "", "| scenario | s | requests | failed | differing | continued | groups in rotation (min..max) "
             "| result |", "|---|---|---|---|---|---|---|---|"]
    for s in payload["scenarios"]:
        result = ", ".join(f"{k} {s[k]}" for k in ("killed", "healed_s", "rollout", "peak_in_rotation", "scaled_in_s")
                           if k in s)
        lines.append(f"| {s['scenario']} | {s['seconds']} | {s['requests']} | {s['failed']} | {s['differing']} | "
                     f"{s['continued']} | {s['min_in_rotation']}..{s['max_in_rotation']} | {result} |")
    lines += ["", "## Gates", "", "| scenario | group | verdict | perplexity Δ % | 95 % interval | top-1 |",
              "|---|---|---|---|---|---|"]
    for s in payload["scenarios"]:
        for g in s.get("gates", []):
            interval = g.get("delta_interval_pct") or ["", ""]
            lines.append(f"| {s['scenario']} | {g['group']} | {g['event']} | {g.get('perplexity_delta_pct')} | "
                         f"{interval[0]} .. {interval[1]} | {g.get('top1_agreement')} |")
    lines += ["", "## Events", ""]
    for s in payload["scenarios"]:
        lines += [f"**{s['scenario']}**", "", *(f"- `{e}`" for e in s["events"]), ""]
    lines += ["![groups in rotation and KV utilization](fleet.png)", ""]
    return "\n".join(lines)


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib  # deferred: only the bench extra installs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as above

    samples = payload["samples"]
    t = [s[0] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    top.step(t, [s[1] for s in samples], where="post", color="tab:blue")
    top.set_ylabel("groups in rotation")
    top.set_ylim(0, max([s[1] for s in samples] + [3]) + 0.5)
    bottom.plot(t, [s[2] for s in samples], color="tab:orange", linewidth=0.8)
    bottom.axhline(80, color="grey", linestyle="--", linewidth=0.7)
    bottom.axhline(35, color="grey", linestyle=":", linewidth=0.7)
    bottom.set_ylabel("mean committed KV % (router)")
    bottom.set_xlabel("seconds")
    for s in payload["scenarios"]:
        for ax in (top, bottom):
            ax.axvline(s["start_s"], color="black", linewidth=0.6)
        top.text(s["start_s"], top.get_ylim()[1] * 0.97, s["scenario"], fontsize=7, rotation=90, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model directory (default smollm2)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-gb", type=float, default=0.05, help="KV cache per rank (default 0.05 GiB)")
    parser.add_argument("--gate-chunks", type=int, default=16, help="golden-set chunks of 512 tokens per gate")
    parser.add_argument("--collective-timeout", type=float, default=10.0,
                        help="the groups' collective timeout (default 10 s: a PP2 group scoring a gate's golden set "
                             "under load on 2 cores can take longer than the worker's 2 s default)")
    parser.add_argument("--baseline-s", type=float, default=20.0, help="the steady-load scenario's length")
    parser.add_argument("--long-streams", type=int, default=12, help="streams of the autoscaling load")
    parser.add_argument("--long-tokens", type=int, default=400, help="max_tokens of the autoscaling load")
    parser.add_argument("--hold-s", type=float, default=120.0, help="longest the autoscaling load runs")
    parser.add_argument("--scale-window", type=float, default=5.0)
    parser.add_argument("--scale-cooldown", type=float, default=10.0)
    parser.add_argument("--registry-url", default=None, help="default: an SQLite file in a temporary directory")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        workdir = Path(tmp)
        model = model_dir(args.model, workdir)
        registry = args.registry_url or f"sqlite:///{workdir / 'registry.db'}"
        stack = FleetStack(workdir, model, "benchfleet", registry, redis_url=args.redis_url)
        bench = Bench(stack, model, args)
        try:
            bench.run()
        finally:
            samples = bench.monitor.stop()
            stack.close()
    payload = {"model": model.name, "args": {k: str(v) for k, v in vars(args).items()},
               "machine": machine(), "load_before": round(load_before, 2), "scenarios": bench.scenarios,
               "samples": [(round(t - bench.t0, 2), n, round(u, 1)) for t, n, u in samples]}
    args.out.mkdir(parents=True, exist_ok=True)
    plot(payload, args.out / "fleet.png")
    (args.out / "fleet.json").write_text(json.dumps(payload, indent=2) + "\n")
    (args.out / "fleet.md").write_text(markdown(payload))
    print(f"wrote fleet.json, fleet.md and fleet.png under {args.out}")
    return 0 if all(s["failed"] == 0 for s in bench.scenarios) else 1


if __name__ == "__main__":
    raise SystemExit(main())
