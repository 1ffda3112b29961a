"""Prefix-aware routing at fleet scale: the router's own pick and reservations (``Router``,
``PromptPrefix``, ``ReplicaGroupView``) driven by simulated replica groups, to show what a routing
decision costs the router and what prefix hit rate the fleet gets as it grows.

``python -m bench.prefix_routing_sim [--fleets 2:40,100:10000,500:10000] [--seconds 5]
[--policies prefix,kv] [--name prefix-routing-sim]``

Each fleet is GROUPS:REQUESTS_PER_S. Every group is a simulated engine: a prefix cache of
``--blocks`` KV blocks of 16 tokens (LRU over block names, ``services.common.prefix_blocks``), and
request times from the planner's cost model for ``--model`` at TP1 on ``--topology`` (decode: its
TPOT at the group's running count; prefill: the uncached tokens at half the GPU's 16-bit peak).
Every 0.25 s each group's view gets what a Stats poll brings (KV in use, the queue, its prefix-cache
events since the last poll), as the router's pollers apply them. The traffic is synthetic chat:
``--system-prompts`` system prompts of 256-1,024 tokens with Zipf popularity, a user turn of
32-128 tokens, 32-128 tokens out; half the requests continue a recent conversation (its last
prompt, its answer and a new turn). Figures per fleet and policy: router CPU per request (naming
the prompt's blocks and the pick with its reservation, on this machine's one core), the p99 of
one decision, the hit rate (prompt tokens the chosen group had cached over all prompt tokens),
and requests no group had headroom for. Writes ``bench/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.serving import machine_line
from services.common.group_status import GroupStatus
from services.common.prefix_blocks import block_hashes, reusable_blocks
from services.planner.cost_model import Candidate, CostModel
from services.planner.specs import load_model_spec
from services.planner.topology import load_topology
from services.router.replicas import ReplicaGroupView, ReplicaSet, Reservation, WorkerStats
from services.router.routing import PromptPrefix, Router

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16
POLL_S = 0.25
MAX_MODEL_LEN = 8192


@dataclass
class Engine:
    """One simulated replica group: its prefix cache (LRU of block names), what runs there, and
    the events its next Stats reply brings."""

    view: ReplicaGroupView
    capacity_blocks: int
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    events: list[tuple[bytes, bool]] = field(default_factory=list)
    seq: int = 0
    running: dict[int, tuple[Reservation, float, float]] = field(default_factory=dict)  # id -> (r, start, tpot)

    def admit(self, names: list[bytes]) -> int:
        """Blocks of the prompt found cached (from the first); the rest are computed and cached."""
        hit = 0
        while hit < len(names) and names[hit] in self.cache:
            self.cache.move_to_end(names[hit])
            hit += 1
        for name in names[hit:]:
            self.cache[name] = None
            self.events.append((name, False))
            if len(self.cache) > self.capacity_blocks:
                evicted, _ = self.cache.popitem(last=False)
                self.events.append((evicted, True))
        return hit

    def poll(self, now: float, bytes_per_token: int) -> WorkerStats:
        used = 0
        for reservation, start, tpot in self.running.values():
            reservation.generated = max(0, min(reservation.max_tokens, int((now - start) / tpot)))
            used += (reservation.prompt_tokens + reservation.generated) * bytes_per_token
        v = self.view
        self.seq += len(self.events)
        stats = WorkerStats(v.replica_group_id, v.model, 1, 1, "bfloat16", used, v.kv_bytes_capacity, bytes_per_token,
                            MAX_MODEL_LEN, running=len(self.running), block_size=BLOCK, prefix_epoch="sim",
                            prefix_seq=self.seq, prefix_events=self.events)
        self.events = []
        return stats


class Traffic:
    """Synthetic chat with shared system prompts and follow-up turns (module docstring)."""

    def __init__(self, rng: random.Random, system_prompts: int, vocab: int = 128_000) -> None:
        self.rng = rng
        self.vocab = vocab
        self.systems = [[rng.randrange(vocab) for _ in range(rng.randint(256, 1024))] for _ in range(system_prompts)]
        weights = [1.0 / (i + 1) for i in range(system_prompts)]  # Zipf, s = 1
        total = sum(weights)
        self.cumulative = []
        acc = 0.0
        for w in weights:
            acc += w / total
            self.cumulative.append(acc)
        self.conversations: list[list[int]] = []

    def _tokens(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(lo, hi))]

    def next(self) -> tuple[list[int], int]:
        """A prompt's token ids and its max_tokens."""
        out = self.rng.randint(32, 128)
        if self.conversations and self.rng.random() < 0.5:
            index = self.rng.randrange(len(self.conversations))
            prompt = self.conversations[index] + self._tokens(32, 128)
            if len(prompt) + out > MAX_MODEL_LEN:
                prompt = prompt[-(MAX_MODEL_LEN - out):]
        else:
            system = self.systems[min(len(self.systems) - 1, _bisect(self.cumulative, self.rng.random()))]
            prompt = system + self._tokens(32, 128)
            index = -1
        answer = prompt + self._tokens(out, out)  # what the next turn re-sends
        if index >= 0:
            self.conversations[index] = answer
        else:
            self.conversations.append(answer)
            if len(self.conversations) > 5000:
                self.conversations.pop(self.rng.randrange(len(self.conversations)))
        return prompt, out


def _bisect(cumulative: list[float], x: float) -> int:
    lo, hi = 0, len(cumulative)
    while lo < hi:
        mid = (lo + hi) // 2
        if cumulative[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def simulate(groups: int, rate: float, seconds: float, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    model = load_model_spec(args.model)
    topology = load_topology(args.topology)
    cost = CostModel(model, topology)
    candidate = Candidate(1, 1, "bfloat16")
    shapes = cost.stage_shapes(candidate)
    tpot_at = [cost.tpot_s(candidate, c, shapes) for c in range(1, 1025)]
    prefill_s_per_token = 2 * model.num_parameters / (topology.peak_dense_flops / 2)
    bytes_per_token = 2 * model.num_layers * model.num_key_value_heads * model.head_dim * 2
    replicas = ReplicaSet()
    engines: list[Engine] = []
    for g in range(groups):
        view, _ = replicas.add(f"sim-{g}")
        view.replica_group_id, view.model = f"rg-{g:03d}", "m"
        view.kv_bytes_capacity, view.kv_bytes_per_token = args.blocks * BLOCK * bytes_per_token, bytes_per_token
        view.max_model_len, view.block_size = MAX_MODEL_LEN, BLOCK
        view.status, view.routable, view.reported_at = GroupStatus.HEALTHY, True, 1.0
        engines.append(Engine(view, args.blocks))
    by_view = {id(e.view): e for e in engines}
    router = Router(replicas, prefix_affinity=policy == "prefix")
    traffic = Traffic(rng, args.system_prompts)
    events: list[tuple[float, int, int]] = []  # (time, kind 0 done / 1 poll, request id)
    heapq.heappush(events, (POLL_S, 1, 0))
    now, ids = 0.0, 0
    decisions: list[float] = []
    prompt_tokens = hit_tokens = unplaced = 0
    while now < seconds:
        now += rng.expovariate(rate)
        while events and events[0][0] <= now:
            when, kind, rid = heapq.heappop(events)
            if kind == 1:
                for engine in engines:
                    engine.view.apply_stats(engine.poll(when, bytes_per_token), now=when, wall_ms=int(when * 1000))
                heapq.heappush(events, (when + POLL_S, 1, 0))
            else:
                engine, reservation = done.pop(rid)
                engine.running.pop(rid)
                router.release(reservation)
        prompt, out = traffic.next()
        t0 = time.perf_counter()
        reservation = router.try_reserve("m", len(prompt), out, prefix=PromptPrefix(prompt))
        decisions.append(time.perf_counter() - t0)
        ids += 1
        if reservation is None:
            unplaced += 1
            continue
        engine = by_view[id(reservation.group)]
        hit = engine.admit(block_hashes(prompt, BLOCK, limit=reusable_blocks(len(prompt), BLOCK))) * BLOCK
        prompt_tokens += len(prompt)
        hit_tokens += hit
        tpot = tpot_at[min(len(engine.running), len(tpot_at) - 1)]
        start = now + (len(prompt) - hit) * prefill_s_per_token
        engine.running[ids] = (reservation, start, tpot)
        done[ids] = (engine, reservation)
        heapq.heappush(events, (start + out * tpot, 0, ids))
    decisions.sort()
    return {"groups": groups, "requests_per_s": rate, "policy": policy, "requests": ids,
            "router_us_per_request": round(sum(decisions) / len(decisions) * 1e6, 1),
            "decision_p99_us": round(decisions[int(0.99 * (len(decisions) - 1))] * 1e6, 1),
            "hit_rate": round(hit_tokens / max(1, prompt_tokens), 4), "unplaced": unplaced,
            "router_cores_at_rate": round(sum(decisions) / len(decisions) * rate, 3)}


done: dict[int, tuple[Engine, Reservation]] = {}


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"# Prefix-aware routing, simulated fleets: {result['name']}", "", f"Machine: {result['machine']}", "",
             (f"{cfg['model']} at TP1 on {cfg['topology']} (the planner's cost model), {cfg['blocks']} KV blocks of "
              f"{BLOCK} tokens per group, {cfg['system_prompts']} system prompts (Zipf), half the requests "
              f"follow-up turns; {cfg['seconds']} s of traffic per row."), "",
             "| groups | req/s | policy | requests | router us/request | decision p99 us | router cores at that rate "
             "| hit rate | unplaced |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['groups']} | {r['requests_per_s']:g} | {r['policy']} | {r['requests']} | "
                     f"{r['router_us_per_request']} | {r['decision_p99_us']} | {r['router_cores_at_rate']} | "
                     f"{r['hit_rate']:.3f} | {r['unplaced']} |")
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_routing_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleets", default="2:40,100:10000,500:10000", help="GROUPS:REQUESTS_PER_S, comma-separated")
    parser.add_argument("--policies", default="prefix,kv")
    parser.add_argument("--seconds", type=float, default=5.0, help="simulated seconds of traffic per row")
    parser.add_argument("--blocks", type=int, default=10_000, help="KV blocks per group")
    parser.add_argument("--system-prompts", type=int, default=2000)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--topology", default="h100-80g-8x")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="prefix-routing-sim")
    args = parser.parse_args(argv)
    rows = []
    for fleet in args.fleets.split(","):
        groups, rate = fleet.split(":")
        for policy in args.policies.split(","):
            done.clear()
            row = simulate(int(groups), float(rate), args.seconds, policy, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {"name": args.name, "machine": machine_line(),
              "config": {k: getattr(args, k) for k in ("seconds", "blocks", "system_prompts", "model", "topology",
                                                       "seed")},
              "rows": rows, "command": "python -m bench.prefix_routing_sim " + " ".join(argv or sys.argv[1:])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
