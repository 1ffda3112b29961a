"""The suite's xdist scheduler (tests/lanes.py): the last of three workers takes only the files
marked ``waits`` and then the ``background`` ones, the others every other file first, each file
whole and in collection order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.lanes import WAITS_FILE, LaneScheduling, collect_after_the_others, collection_ended, record_lane_files

COLLECTION = ["t/a.py::one", "t/a.py::two", "t/w.py::one", "t/b.py::one", "t/c.py::one", "t/w2.py::one",
              "t/w2.py::two", "t/w2.py::three", "t/d.py::one", "t/e.py::one", "t/w3.py::one"]
WAITS = ["t/w.py", "t/w2.py", "t/w3.py"]


class Node:
    """The part of an xdist WorkerController a scheduler drives."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[str] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += [COLLECTION[i] for i in indices]

    def shutdown(self) -> None:
        self.shutting_down = True


def scheduler(tmp_path, workers: int, background: tuple[str, ...] = ()) -> tuple[LaneScheduling, list[Node]]:
    config = SimpleNamespace(getvalue=lambda name: {"tx": [f"{workers}*popen"]}[name],
                             option=SimpleNamespace(loadscopereorder=False),
                             _tmp_path_factory=SimpleNamespace(getbasetemp=lambda: tmp_path))
    (tmp_path / WAITS_FILE).write_text(json.dumps({"waits": WAITS, "background": list(background)}))
    sched = LaneScheduling(config)
    nodes = [Node(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, COLLECTION)
    sched.schedule()
    return sched, nodes


def files(node: Node) -> list[str]:
    return list(dict.fromkeys(nodeid.split("::")[0] for nodeid in node.sent))


def run_all(sched: LaneScheduling, nodes: list[Node]) -> None:
    """Complete the tests sent to ``nodes``, in turn, until none has any left to run."""
    done = {node: 0 for node in nodes}
    while any(done[node] < len(node.sent) for node in nodes):
        for node in nodes:
            if done[node] < len(node.sent):
                sched.mark_test_complete(node, COLLECTION.index(node.sent[done[node]]))
                done[node] += 1


def test_the_third_worker_is_a_lane_for_the_waiting_files(tmp_path):
    sched, (gw0, gw1, lane) = scheduler(tmp_path, 3)
    assert files(lane) == ["t/w.py", "t/w2.py"]  # both at once: the lane queues up to two files
    assert set(files(gw0) + files(gw1)) <= {"t/a.py", "t/b.py", "t/c.py", "t/d.py", "t/e.py"}
    run_all(sched, [lane])  # quicker than the others: it takes the third waiting file too
    assert files(lane) == ["t/w.py", "t/w2.py", "t/w3.py"] and lane.shutting_down
    run_all(sched, [gw0, gw1])
    assert sorted(gw0.sent + gw1.sent + lane.sent) == sorted(COLLECTION)  # each test once
    assert sched.tests_finished and gw0.shutting_down and gw1.shutting_down


def test_the_other_workers_take_the_waiting_files_once_nothing_else_is_left(tmp_path):
    sched, (gw0, gw1, lane) = scheduler(tmp_path, 3)
    run_all(sched, [gw0, gw1])  # the lane is still on its first two files
    assert "t/w3.py" in files(gw0) + files(gw1) and "t/w3.py" not in files(lane)
    assert sorted(gw0.sent + gw1.sent + lane.sent) == sorted(COLLECTION)


def test_the_lane_then_takes_the_background_files_from_the_end(tmp_path):
    sched, (gw0, gw1, lane) = scheduler(tmp_path, 3, background=("t/b.py", "t/d.py", "t/e.py"))
    run_all(sched, [lane])  # the waiting files, then the background ones, the shortest (last) first
    left = [f for f in ("t/e.py", "t/d.py", "t/b.py") if f not in files(gw0) + files(gw1)]
    assert left and files(lane) == ["t/w.py", "t/w2.py", "t/w3.py", *left]
    assert lane.shutting_down and "t/c.py" not in files(lane)  # an unmarked file is never the lane's
    run_all(sched, [gw0, gw1])
    assert sorted(gw0.sent + gw1.sent + lane.sent) == sorted(COLLECTION)


def test_idle_priority_is_the_kernels_idle_class(tmp_path):
    """run_in_the_background() in a child: each of its threads ends in SCHED_IDLE."""
    script = ("import os, threading\n"
              "from tests.lanes import run_in_the_background\n"
              "done = threading.Event(); t = threading.Thread(target=done.wait); t.start()\n"
              "run_in_the_background()\n"
              "print(sorted({os.sched_getscheduler(int(tid)) for tid in os.listdir('/proc/self/task')}))\n"
              "done.set()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == str([os.SCHED_IDLE])


def test_two_workers_have_no_lane(tmp_path):
    sched, nodes = scheduler(tmp_path, 2)
    run_all(sched, nodes)
    assert [files(node)[0] for node in nodes] == ["t/a.py", "t/w.py"]  # in collection order


def test_a_waiting_test_may_not_be_serial():
    item = SimpleNamespace(nodeid="t/w.py::one", keywords={"waits": 1, "serial": 1}, fixturenames=[])
    with pytest.raises(pytest.UsageError, match="neither `serial` nor use `alone`"):
        record_lane_files(None, [item])


def test_a_background_test_may_not_use_alone():
    item = SimpleNamespace(nodeid="t/b.py::one", keywords={"background": 1}, fixturenames=["alone"])
    with pytest.raises(pytest.UsageError, match="neither `serial` nor `waits` nor use `alone`"):
        record_lane_files(None, [item])


def test_the_lane_collects_once_another_worker_ended_its_collection_however_it_ended(tmp_path):
    """The lane waits for another worker's collection to end, not for its lane files: a run given
    a path that does not exist writes none, and had kept the lane (and the run) waiting 120 s."""
    ended = threading.Timer(0.3, collection_ended, args=(tmp_path,))
    ended.start()
    t0 = time.monotonic()
    collect_after_the_others(tmp_path, timeout_s=30)
    assert 0.25 < time.monotonic() - t0 < 5 and not (tmp_path / WAITS_FILE).exists()
