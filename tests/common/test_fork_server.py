"""The fork server: a forked child is the process a fresh ``python -m`` would have been (command
line, session, standard streams, environment, exit code), and it lives or dies with its
launcher as asked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.fork_server import ForkServer, kill_group, live_process

pytestmark = pytest.mark.waits  # on children exiting with their launcher (tests/lanes.py)

CHILD = "tests.common.fork_child"


def _cmdline(pid: int) -> list[str]:
    return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") if a]


def _until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def server():
    server = ForkServer(["json"])
    yield server
    server.close()


def test_a_forked_child_is_what_python_m_would_start(server, tmp_path, monkeypatch):
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", CHILD, str(report), "3"]
    env = {**os.environ, "FORK_TEST": "yes"}
    assert not server.fits(argv, env, tmp_path / "child.log")  # not the server's environment
    monkeypatch.setenv("FORK_TEST", "yes")
    assert server.fits(argv, dict(os.environ), tmp_path / "child.log")
    assert not server.fits(argv, dict(os.environ), None)  # its output must go somewhere
    child = server.spawn(argv, dict(os.environ), tmp_path / "child.log")
    assert child.wait(timeout=30) == 3 and child.poll() == 3
    seen = json.loads(report.read_text())
    assert seen["argv"][1:] == [str(report), "3"] and seen["argv"][0].endswith("fork_child.py")
    assert seen == {**seen, "cwd": os.getcwd(), "env": "yes", "sid": True, "stdin": "", "sigterm": True}
    assert (tmp_path / "child.log").read_text() == "to the log\n"


def test_a_killed_child_reports_the_signal_and_shows_its_own_command_line(server, tmp_path):
    argv = [sys.executable, "-m", CHILD, str(tmp_path / "report.json"), "-1"]
    child = server.spawn(argv, dict(os.environ), tmp_path / "child.log")
    _until(lambda: (tmp_path / "report.json").exists())
    assert _cmdline(child.pid) == argv  # what ps shows, as if started fresh
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_children_die_with_the_launcher_unless_kept(tmp_path):
    """The launcher is SIGKILLed: its fork server goes, a child asked to die with it gets SIGTERM,
    a kept child goes on."""
    script = f"""
import os, sys, time
from pathlib import Path
from services.common.fork_server import ForkServer
server = ForkServer(["json"])
tmp = Path({str(tmp_path)!r})
argv = lambda name: [sys.executable, "-m", {CHILD!r}, str(tmp / name), "-1"]
dies = server.spawn(argv("dies.json"), dict(os.environ), tmp / "dies.log")
kept = server.spawn(argv("kept.json"), dict(os.environ), tmp / "kept.log", die_with_parent=False)
print(dies.pid, kept.pid, flush=True)
time.sleep(60)
"""
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    dies, kept = map(int, launcher.stdout.readline().split())
    _until(lambda: (tmp_path / "dies.json").exists() and (tmp_path / "kept.json").exists())
    launcher.kill()
    launcher.wait()
    try:
        _until(lambda: not Path(f"/proc/{dies}").exists() or "Z" in Path(f"/proc/{dies}/stat").read_text().split()[2])
        time.sleep(0.5)
        assert Path(f"/proc/{kept}").exists(), "the kept child died with its launcher"
    finally:
        for pid in (dies, kept):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_request_queued_by_a_launcher_that_died_is_not_forked(tmp_path):
    """The launcher asks for a kept child while its server still imports, and is SIGKILLed: the
    server, done importing, forks nothing (a kept child no one learned the pid of would live on
    unknown) and exits."""
    script = f"""
import os, sys, threading, time
from pathlib import Path
from services.common.fork_server import ForkServer
server = ForkServer(["tests.common.slow_import"])
argv = [sys.executable, "-m", {CHILD!r}, {str(tmp_path / "kept.json")!r}, "-1"]
threading.Thread(target=server.spawn, args=(argv, dict(os.environ), Path({str(tmp_path / "kept.log")!r})),
                 kwargs={{"die_with_parent": False}}, daemon=True).start()
while server._proc is None:
    time.sleep(0.01)
time.sleep(0.3)  # the request is written before the server has imported
print(server._proc.pid, flush=True)
time.sleep(60)
"""
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    fork_server = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    _until(lambda: not live_process(fork_server), timeout_s=30)
    time.sleep(0.5)
    assert not (tmp_path / "kept.json").exists(), "a child was forked for a launcher that was gone"


def test_the_group_of_an_exited_leader_is_killed_unless_its_pid_leads_another():
    # the leader exits at once, its child (a rank, say) is left in the group
    leader = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE, start_new_session=True)
    orphan = int(leader.stdout.readline())
    assert leader.wait(timeout=10) == 0
    assert live_process(orphan) and os.getpgid(orphan) == leader.pid
    kill_group(leader.pid, leader_alive=False)
    deadline = time.monotonic() + 5
    while live_process(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live_process(orphan)
    # a live process that has the pid and leads its own group (what a reused pid looks like) is spared
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        kill_group(other.pid, leader_alive=False)
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
