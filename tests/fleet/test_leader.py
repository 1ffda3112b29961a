"""The fleet controller's lease, on PostgreSQL and SQLite: one holder acts, a standby takes over
once the holder stops renewing, and a deposed holder's registry is fenced out of every write."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from bench._fleet_stack import fleet_spec
from services.common.config import child_environ
from services.common.ports import free_port
from services.common.registry import Fenced, ShardRegistry, registry_group_id
from services.fleet.leader import LEASE as LEASE_PREFIX
from services.fleet.leader import RENEW_DEADLINE, LeaderElection
from tests.router.processes import REPO, stop
from tests.stack import fresh_database
from tests.telemetry.procs import wait_until

TTL = 10.0
LEASE = "fleet-controller/smol"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry(registry_of_each_kind: ShardRegistry) -> ShardRegistry:
    return registry_of_each_kind


def elections(registry: ShardRegistry, clock: Clock) -> tuple[LeaderElection, LeaderElection]:
    return (LeaderElection(registry, holder="a", ttl_s=TTL, name=LEASE, clock=clock),
            LeaderElection(registry, holder="b", ttl_s=TTL, name=LEASE, clock=clock))


def test_a_standby_takes_over_only_after_the_holder_stops_renewing_and_the_old_term_is_fenced_out(registry):
    clock = Clock()
    a, b = elections(registry, clock)
    assert a.step() and a.term == 1  # a free lease is taken at once
    assert not b.step()
    fenced_a = registry.fenced(LEASE, 1)
    fenced_a.apply_fleet("smol", "{}")  # the holder writes
    for _ in range(5):  # renewals every 3 s: b never sees the lease unchanged for a TTL
        clock.now += 3
        assert a.step() and not b.step()
    # a is paused (SIGSTOP): it stops renewing; b times the same (holder, term, renewals) for a TTL
    clock.now += 3
    assert not b.step()
    clock.now += TTL - 4  # 9 s unchanged
    assert not b.step()
    clock.now += 1
    assert b.step() and b.term == 2
    with pytest.raises(Fenced, match="term 1 is over .term 2 now"):
        fenced_a.apply_fleet("smol", '{"replicas": 2}')  # a wakes up and writes: refused
    assert registry.fleet_revision("smol").revision == 1
    assert not a.step() and a.term is None  # its renewal finds the lease taken: a stands by
    fenced_b = registry.fenced(LEASE, 2)
    assert fenced_b.apply_fleet("smol", '{"replicas": 2}')[0].revision == 2
    fenced_a.close()
    fenced_b.close()


def test_a_holder_that_cannot_renew_stops_acting_before_anyone_may_take_over(registry, monkeypatch):
    clock = Clock()
    a, _ = elections(registry, clock)
    assert a.step()

    def outage(*_args, **_kwargs):
        raise ConnectionError("registry unreachable")

    monkeypatch.setattr(registry, "renew_lease", outage)
    clock.now += TTL * RENEW_DEADLINE - 0.5
    assert a.step()  # not renewed yet, still within its deadline
    clock.now += 1.0
    assert not a.step()  # past it: it stops, while an observer still waits out the full TTL


def test_a_released_lease_is_taken_at_once_and_a_killed_local_holder_is_not_waited_for(registry):
    clock = Clock()
    a, b = elections(registry, clock)
    assert a.step()
    assert not b.step()
    a.release()
    assert b.step() and b.term == 2  # no TTL to wait: a stopped cleanly
    # a holder on this host whose process is gone (a SIGKILLed controller) is not waited for either
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ghost = f"{socket.gethostname()}:{int(dead.stdout)}"
    assert registry.take_lease(LEASE, ghost, TTL, seen=registry.read_lease(LEASE)) is not None
    c = LeaderElection(registry, ttl_s=TTL, name=LEASE, clock=clock)
    assert c.step() and c.term == 4
    assert c.holder == f"{socket.gethostname()}:{os.getpid()}"


def test_two_takers_racing_for_one_lease_get_one_term_each_at_most(registry):
    seen = registry.read_lease(LEASE)
    results: list[object] = []
    barrier = threading.Barrier(4)

    def take(holder: str) -> None:
        barrier.wait()
        results.append(registry.take_lease(LEASE, holder, TTL, seen=seen))

    threads = [threading.Thread(target=take, args=(f"h{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [r for r in results if r is not None]
    assert len(results) == 4 and len(won) == 1, results
    assert registry.read_lease(LEASE).holder == won[0].holder


def test_a_fenced_transaction_in_flight_finishes_before_a_takeover_on_postgresql(request):
    """The fence holds the lease row (FOR SHARE) to the end of the transaction: a takeover that
    starts meanwhile waits, so a write under term 1 never lands after term 2 began."""
    with fresh_database(request.getfixturevalue("postgres_url"), "lease") as url, \
            ShardRegistry(url, migrate_schema=True) as registry:
        clock = Clock()
        a, _ = elections(registry, clock)
        assert a.step()
        fenced = registry.fenced(LEASE, 1)
        order: list[str] = []
        with fenced._tx() as session:  # term 1's transaction is open, its fence checked
            taker = threading.Thread(target=lambda: order.append(
                f"taken {registry.take_lease(LEASE, 'b', TTL, seen=registry.read_lease(LEASE)).term}"))
            taker.start()
            time.sleep(0.5)
            order.append("term 1 commits")
            assert session is not None
        taker.join(30)
        assert order == ["term 1 commits", "taken 2"]
        fenced.close()


def test_a_holder_stalled_inside_a_fenced_transaction_delays_a_takeover_by_a_second_not_forever(request):
    """A holder paused (SIGSTOP) between two statements of a fenced transaction holds the lease row;
    PostgreSQL ends that transaction after the fenced registry's stall limit, the takeover goes
    through, and the stalled transaction's next statement fails instead of writing under term 1."""
    with fresh_database(request.getfixturevalue("postgres_url"), "lease") as url, \
            ShardRegistry(url, migrate_schema=True) as registry:
        a, _ = elections(registry, Clock())
        assert a.step()
        fenced = registry.fenced(LEASE, 1)
        with pytest.raises(Exception, match="idle-in-transaction|terminat|closed"):  # noqa: B017
            with fenced._tx() as session:
                t0 = time.monotonic()
                taken = registry.take_lease(LEASE, "b", TTL, seen=registry.read_lease(LEASE))
                waited = time.monotonic() - t0
                assert taken is not None and taken.term == 2, taken
                assert waited < 2.0, waited
                session.execute(sa.text("SELECT 1"))  # the paused holder wakes up: its transaction is gone
        assert registry.read_lease(LEASE).holder == "b"
        fenced.close()


# ---- two `shardline serve fleet` processes ------------------------------------------------

PROCESS_TTL_S = 3.0
INTERVAL_S = 0.5


def _controller(name: str, registry_url: str, tmp_path: Path) -> subprocess.Popen:
    log = (tmp_path / f"{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "fleet", "--port", str(free_port()), "--fleet", "lead",
         "--registry-url", registry_url, "--log-dir", str(tmp_path / "groups"), "--interval",
         str(INTERVAL_S), "--lease-ttl", str(PROCESS_TTL_S), "--keep-groups"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=child_environ(), start_new_session=True)


def _until(what: str, predicate, timeout_s: float, logs: Path):
    value = wait_until(predicate, timeout_s)
    if not value:
        text = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(logs.glob("*.log")))
        raise AssertionError(f"not within {timeout_s} s: {what}\n{text}")
    return value


@pytest.mark.slow
def test_a_leader_stopped_mid_rollout_is_replaced_by_the_standby_which_finishes_it_and_fences_it_out(
        tiny_model_dir, postgres_url, tmp_path):
    def spec_file(revision: int, **plan) -> Path:
        path = tmp_path / f"lead-{revision}.yaml"
        path.write_text(yaml.safe_dump(fleet_spec("lead", tiny_model_dir, replicas=1, kv_cache_cap_gb=1 / 1024,
                                                  gate_chunks=2, gate_chunk_tokens=128, drain_deadline_s=3.0,
                                                  settle_s=1.0, **plan)))
        return path

    def apply(path: Path) -> None:
        subprocess.run([sys.executable, "-m", "services.cli", "apply", "-f", str(path), "--registry-url", url],
                       cwd=REPO, env=child_environ(), check=True, capture_output=True, timeout=120)

    lease_name = f"{LEASE_PREFIX}/lead"
    with fresh_database(postgres_url, "lead") as url, ShardRegistry(url, migrate_schema=True) as registry:
        apply(spec_file(1))
        a = _controller("a", url, tmp_path)
        b = None
        try:
            lease = _until("a holds the lease", lambda: registry.read_lease(lease_name), 60, tmp_path)
            assert lease.holder.endswith(f":{a.pid}") and lease.term == 1

            def serving() -> list[str]:
                return [g.name for g in registry.fleet_groups("lead") if g.status == "healthy"]

            (group,) = _until("a group in rotation", serving, 120, tmp_path)
            b = _controller("b", url, tmp_path)
            time.sleep(PROCESS_TTL_S)  # b watches a renewing lease: it stands by
            assert registry.read_lease(lease_name).holder.endswith(f":{a.pid}")

            # mid-rollout: a has started the candidate of revision 2 (PP2) when it hangs; the group
            # processes (kept: they outlive their controllers) serve on
            apply(spec_file(2, pp=2))
            (candidate,) = _until("a candidate loading", lambda: [g.name for g in registry.fleet_groups("lead")
                                                                  if g.pp_degree == 2], 60, tmp_path)
            os.kill(a.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            lease = _until("b takes the lease", lambda: (lease := registry.read_lease(lease_name)) and
                           lease.holder.endswith(f":{b.pid}") and lease, PROCESS_TTL_S * 3, tmp_path)
            took = time.monotonic() - t0
            assert lease.term == 2
            # within the TTL and a reconcile of both (a's last renewal may be that old), plus a poll
            assert took < PROCESS_TTL_S + 2 * INTERVAL_S + 1.0, took
            # b adopts the candidate a started (no second one), gates it and drains the old group
            _until("b finishes the rollout", lambda: registry.latest_rollout("lead").status == "succeeded", 90,
                   tmp_path)
            _until("the old group gone", lambda: serving() == [candidate] and
                   [g.name for g in registry.fleet_groups("lead")] == [candidate], 30, tmp_path)

            os.kill(a.pid, signal.SIGCONT)  # a wakes up believing it leads: it finds its term over
            _until("a steps down", lambda: "term 1 is over" in (tmp_path / "a.log").read_text(), 10, tmp_path)
            with registry.fenced(lease_name, 1) as old_term, pytest.raises(Fenced):  # what a write of a's meets
                old_term.set_status(registry_group_id(candidate), "draining", reason="a, deposed", by="fleet")
            time.sleep(2 * INTERVAL_S)
            assert registry.read_lease(lease_name).term == 2
            assert [g.name for g in registry.fleet_groups("lead")] == [candidate] and serving() == [candidate]
            assert [r.status for r in registry.list_rollouts("lead")] == ["succeeded"]  # once, by b
            assert "Fenced" not in (tmp_path / "b.log").read_text()

            # SIGKILL the new leader: the group serves on, and a, on the same host, takes over at
            # once and adopts it again
            os.kill(b.pid, signal.SIGKILL)
            b.wait(10)
            lease = _until("a takes the lease back", lambda: (lease := registry.read_lease(lease_name))
                           and lease.holder.endswith(f":{a.pid}") and lease, 4 * INTERVAL_S + 2, tmp_path)
            assert lease.term == 3
            time.sleep(4 * INTERVAL_S)
            assert [g.name for g in registry.fleet_groups("lead")] == [candidate] and serving() == [candidate]
            assert group != candidate
        finally:
            for proc in (b, a):
                if proc is not None:
                    if proc.poll() is None:
                        os.kill(proc.pid, signal.SIGCONT)
                    stop(proc, timeout_s=20)
            for record in (tmp_path / "groups" / "groups").glob("*.json"):  # kept groups outlive their controllers
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(json.loads(record.read_text())["pid"], signal.SIGKILL)
