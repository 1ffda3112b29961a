"""The run lock the suite's workers share (tests/conftest.py): an ``alone`` block runs while no
other test does, and one reserved early waits only for the tests that were running then."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from tests.conftest import Alone, _run_lock


def _config(tmp_path) -> SimpleNamespace:
    return SimpleNamespace(_serial_lock_dir=tmp_path)


def _started(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_reserved_block_stops_new_tests_and_waits_only_for_the_running_ones(tmp_path):
    config = _config(tmp_path)
    events: list[str] = []
    other_ends = threading.Event()

    def running_test() -> None:  # another worker's test, running when the block is reserved
        with _run_lock(config, exclusive=False):
            events.append("running test holds")
            other_ends.wait(10)
            events.append("running test ends")

    running = _started(running_test)
    while "running test holds" not in events:
        time.sleep(0.01)
    with _run_lock(config, exclusive=False) as locks:  # the test that will run a block alone
        alone = Alone(locks, serial=False)
        alone.reserve()

        def next_test() -> None:  # a worker starting its next test after the reservation
            with _run_lock(config, exclusive=False):
                events.append("next test starts")

        waiting = _started(next_test)
        time.sleep(0.3)
        assert "next test starts" not in events  # the gate is taken: no test starts

        def block() -> None:
            with alone():
                events.append("block runs")
                time.sleep(0.2)
                events.append("block ends")

        blocked = _started(block)
        time.sleep(0.3)
        assert "block runs" not in events  # the running test still holds its share
        other_ends.set()
        for thread in (running, blocked, waiting):
            thread.join(10)
    assert events == ["running test holds", "running test ends", "block runs", "block ends", "next test starts"]


def test_without_a_lock_dir_the_block_just_runs(tmp_path):
    with _run_lock(SimpleNamespace(), exclusive=False) as locks:
        alone = Alone(locks, serial=False)
        alone.reserve()
        with alone():
            pass
