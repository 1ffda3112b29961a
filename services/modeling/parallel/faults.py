"""Fault injection for failure tests: make one rank die, hang or slow down at a chosen op.

Set ``SHARDLINE_FAULTS`` to one or more ``;``-separated specs, each ``key=value`` pairs joined
by ``,``:

    rank=1,op=all_reduce,after=5,action=kill      # SIGKILL rank 1 at its 6th all-reduce
    rank=0,op=recv,action=stop                    # SIGSTOP itself (a hung peer)
    rank=2,op=all_reduce,action=sleep:0.05        # a slow rank: sleep before every all-reduce
    rank=1,op=recv,after=3,times=1,action=sleep:1.5   # a link flap: one late recv (its peer's
                                                      # send waits 1.5 s), then all is well

``times`` caps how often a fault strikes (default: every match after ``after``). ``op=any``
matches every op. Only the coordinator consults this, so a fault can only strike
where a real failure would: at a collective.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field


@dataclass
class Fault:
    rank: int
    op: str = "any"
    after: int = 0
    action: str = "kill"
    times: int | None = None  # None: every match after ``after``
    seen: int = field(default=0, compare=False)

    def matches(self, rank: int, op: str) -> bool:
        return rank == self.rank and self.op in ("any", op)


def parse_faults(spec: str | None) -> list[Fault]:
    faults: list[Fault] = []
    for part in (spec or "").split(";"):
        part = part.strip()
        if not part:
            continue
        fields = dict(item.split("=", 1) for item in part.split(","))
        unknown = set(fields) - {"rank", "op", "after", "times", "action"}
        if unknown or "rank" not in fields:
            raise ValueError(f"bad SHARDLINE_FAULTS entry {part!r}: needs rank=, allows op=, after=, times=, "
                             f"action=")
        times = int(fields["times"]) if "times" in fields else None
        faults.append(Fault(rank=int(fields["rank"]), op=fields.get("op", "any"),
                            after=int(fields.get("after", 0)), action=fields.get("action", "kill"), times=times))
    return faults


class FaultInjector:
    def __init__(self, rank: int, spec: str | None = None) -> None:
        self.rank = rank
        self.faults = [f for f in parse_faults(spec if spec is not None else os.environ.get("SHARDLINE_FAULTS"))
                       if f.rank == rank]

    def __bool__(self) -> bool:
        return bool(self.faults)

    def before(self, op: str) -> None:
        for fault in self.faults:
            if not fault.matches(self.rank, op):
                continue
            fault.seen += 1
            if fault.seen <= fault.after:
                continue
            if fault.times is not None and fault.seen > fault.after + fault.times:
                continue
            if fault.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.action.startswith("sleep:"):
                time.sleep(float(fault.action.split(":", 1)[1]))
            else:
                raise ValueError(f"unknown fault action {fault.action!r}")
