"""Lanes for pytest-xdist: the files whose tests mostly wait get a worker of their own.

A file marked ``waits`` (``pytestmark = pytest.mark.waits``) spends its time on keepalive pings,
expiring entries and timeouts, not on the CPU. On two workers it held a worker idle for that
time while the other had both cores' worth of work queued. With ``-n 3`` or more, the last
worker is the waiting lane: it takes only ``waits`` files, the other workers take every other
file (and ``waits`` files too once nothing else is left), in the order the collection sorted
them (tests/conftest.py: longest first). A ``waits`` test holds no share of the run lock that
``serial`` tests and ``alone`` blocks take exclusively: it uses too little CPU to skew them, and
a serial test would otherwise wait out a 20 s keepalive test while the gate kept the other
workers idle. It only waits, before it starts, while one of them runs, so that it does not
start its processes beside it. So a ``waits`` file may use neither.

Once the ``waits`` files are handed out, the lane takes the files marked ``background`` (tests
that run in the test process alone: no service, no rank, no clock), the shortest first (from the
end of the queue, which the other workers take from its front), and runs them at the kernel's
idle priority (``SCHED_IDLE``): they get a core only while no other process wants it, when the
other workers' tests wait on their processes. They take the run lock as every other test does.

The workers know the markers, the scheduler (in the controller) only node ids: each worker
writes the ``waits`` and ``background`` files it collected to the run's base temp dir, which the
controller reads once every worker has reported its collection (all the same, or xdist stops
the run).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

WAITS_FILE = "waits.json"
COLLECTED_FILE = "collected"  # a worker's collection ended, however it ended
LANE_FROM_WORKERS = 3


def has_lane(config: pytest.Config) -> bool:
    """In a worker: the run has a waiting lane (three workers or more); else a ``waits`` test
    takes the run lock as every other test does."""
    return getattr(config, "workerinput", {}).get("workercount", 0) >= LANE_FROM_WORKERS


def is_lane_worker(config: pytest.Config) -> bool:
    workerinput = getattr(config, "workerinput", {})
    count = workerinput.get("workercount", 0)
    return count >= LANE_FROM_WORKERS and workerinput.get("workerid") == f"gw{count - 1}"


def collect_after_the_others(run_dir: Path | None, timeout_s: float = 120.0) -> None:
    """In the lane's worker: collect once another worker has written its collection. Its imports
    compiled the bytecode the lane then reads: in a fresh clone nothing is compiled yet, and a
    third process compiling the same modules at once took its CPU from the two that run first
    (a cold collection is 25 CPU-seconds on the AVX2 EPYC, a warm one 9.5). The lane's first
    files can wait: it finishes long before the others. A collection that failed (a path that
    does not exist, a module that does not import) ends the wait too: the run stops at once."""
    if run_dir is None:
        return
    deadline = time.monotonic() + timeout_s
    while not (run_dir / COLLECTED_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def collection_ended(run_dir: Path | None) -> None:
    """In a worker other than the lane's: its collection ended (the lane may collect now)."""
    if run_dir is not None:
        (run_dir / COLLECTED_FILE).touch()


def _files_marked(items: list[pytest.Item], marker: str) -> list[str]:
    return sorted({item.nodeid.split("::", 1)[0] for item in items if marker in item.keywords})


# Each lane's marker, why its tests cannot also be what follows, and the markers they cannot carry
# (none of them may use `alone` either)
_RULED_OUT = {"waits": ("runs outside the run lock", ("serial",)),
              "background": ("may run at idle priority", ("serial", "waits"))}


def record_lane_files(run_dir: Path | None, items: list[pytest.Item]) -> None:
    """In a worker: write the collected ``waits`` and ``background`` files for the scheduler;
    refuse a test whose lane marker rules out another marker of it or the ``alone`` fixture."""
    for item in items:
        for marker, (why, others) in _RULED_OUT.items():
            if marker in item.keywords and (any(other in item.keywords for other in others)
                                            or "alone" in getattr(item, "fixturenames", ())):
                neither = " nor ".join(f"`{other}`" for other in others)
                raise pytest.UsageError(f"{item.nodeid}: a `{marker}` test {why}, so it can be neither {neither} "
                                        "nor use `alone`")
    if run_dir is None:
        return
    tmp = run_dir / f"{WAITS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"waits": _files_marked(items, "waits"),
                               "background": _files_marked(items, "background")}))
    os.replace(tmp, run_dir / WAITS_FILE)  # every worker writes the same lists; a reader sees whole ones


def run_in_the_background() -> None:
    """Put every thread of this process (and so what they start from now on) at the kernel's idle
    priority: a core only while no other process wants it. Once is enough."""
    if os.sched_getscheduler(0) == os.SCHED_IDLE:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


class LaneScheduling(LoadFileScheduling):
    """pytest-xdist's ``--dist loadfile``, with the last of three or more workers a lane for the
    ``waits`` files."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self.run_dir: Path = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
        self._marked: dict[str, set[str]] | None = None

    def marked(self, marker: str) -> set[str]:
        """The files marked ``waits`` or ``background``, as the workers recorded them."""
        if self._marked is None:
            path = self.run_dir / WAITS_FILE
            recorded = json.loads(path.read_text()) if path.exists() else {}
            self._marked = {name: set(recorded.get(name, ())) for name in ("waits", "background")}
        return self._marked[marker]

    def is_lane(self, node) -> bool:
        return self.numnodes >= LANE_FROM_WORKERS and node.gateway.id == f"gw{self.numnodes - 1}"

    def _assign_work_unit(self, node) -> None:
        lane = self.is_lane(node)
        waits = self.marked("waits") if self.numnodes >= LANE_FROM_WORKERS else set()
        scope = next((s for s in self.workqueue if (s in waits) == lane), None)
        if scope is None and lane:  # nothing waiting is left: the shortest background file
            background = self.marked("background")
            scope = next((s for s in reversed(self.workqueue) if s in background), None)
            if scope is None:  # nor one of those: the lane ends once its queued tests have run
                node.shutdown()
                return
        if scope is None:
            scope = next(iter(self.workqueue))
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])
