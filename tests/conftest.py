"""Suite-wide fixtures: real PostgreSQL and Redis (started by `make test`, or here on demand)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common import heap
from tests import stack
from tests.lanes import (
    LaneScheduling,
    collect_after_the_others,
    collection_ended,
    has_lane,
    is_lane_worker,
    record_lane_files,
    run_in_the_background,
)
from tests.model_fixtures import smollm2_dir, tiny_model_dir  # noqa: F401  (fixtures for every test)
from tests.s3_fixtures import s3_bucket, s3_endpoint  # noqa: F401


@pytest.fixture(params=["postgresql", "sqlite"])
def registry_of_each_kind(request: pytest.FixtureRequest, tmp_path: Path):
    """A migrated, empty registry: a fresh database on the real PostgreSQL, then a SQLite file."""
    # deferred: only the registry tests pay for SQLAlchemy here
    from services.common.registry import ShardRegistry

    if request.param == "sqlite":
        with ShardRegistry(f"sqlite:///{tmp_path / 'registry.db'}", migrate_schema=True) as registry:
            yield registry
        return
    with stack.fresh_database(request.getfixturevalue("postgres_url"), "registry") as url, \
            ShardRegistry(url, migrate_schema=True) as registry:
        yield registry


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """URL of a real PostgreSQL: the one `make test` started, else a fresh one for this session."""
    url = os.environ.get("SHARDLINE_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    with stack.postgres() as started:
        yield started


def _worker_redis_db(url: str) -> str:
    """``url`` on this pytest-xdist worker's own database number (gw0 → 1, gw1 → 2, ...; 0 when
    not under xdist). The router, the telemetry rules and the stores write unprefixed keys
    (``replica_kv_util``, ``shardhealth:*``) and list every group they find, so workers sharing
    one Redis must not share a database."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not (worker.startswith("gw") and worker[2:].isdigit()):
        return url
    db = int(worker[2:]) + 1
    if db >= stack.REDIS_DATABASES:
        raise RuntimeError(f"{worker}: more pytest-xdist workers than Redis databases ({stack.REDIS_DATABASES})")
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{db}"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis: the one `make test` started, else a fresh one for this session."""
    url = os.environ.get("SHARDLINE_TEST_REDIS_URL")
    if url:
        yield _worker_redis_db(url)
        return
    with stack.redis() as started:
        yield _worker_redis_db(started)


# -- `serial` tests and `alone` blocks under pytest-xdist ----------------------------------------
# A test marked `serial` races a clock that a busy core moves: step times before and after
# telemetry stops, the host's costs a calibration fits, the events a stalled stream takes. Each
# one idles the other worker, so a test whose bound can allow a starved process seconds (a
# collective timeout's waits) does that instead, and a test whose race is one block of it (a
# kill that must land mid-stream, a failure detected within a timeout) runs only that block
# alone (the `alone` fixture), its set-up beside the other workers' tests. On 2 cores the other
# workers' ranks would skew it, so it runs while no other test of the run does: every test
# holds a lock in the base temp dir the run's workers share, a serial test (or block) holds it
# exclusive. The gate in front keeps a waiting serial test from being starved by workers
# taking turns on the shared lock: a worker passes the gate only while no serial test is
# waiting or running.


@contextlib.contextmanager
def _run_lock(config: pytest.Config, exclusive: bool) -> Iterator[tuple | None]:
    lock_dir = getattr(config, "_serial_lock_dir", None)
    if lock_dir is None:
        yield None
        return
    with (lock_dir / "gate.lock").open("w") as gate, (lock_dir / "run.lock").open("w") as run:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(run, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        yield gate, run  # closing the files releases both locks


def _wait_out_serial(config: pytest.Config) -> None:
    """Wait while a serial test (or an `alone` block) runs: it holds the run lock exclusive. Not
    while one waits for its turn (at the gate): that may be the length of another worker's test."""
    lock_dir = getattr(config, "_serial_lock_dir", None)
    if lock_dir is not None:
        with (lock_dir / "run.lock").open("w") as run:
            fcntl.flock(run, fcntl.LOCK_SH)


_LOCKS = pytest.StashKey[tuple | None]()


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin has set up its factory
def pytest_configure(config: pytest.Config) -> None:
    heap.starting()  # collection imports torch and every service: see pytest_collection_finish
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the workers' base temp dirs (popen-gw0, ...) share one parent per run
        config._serial_lock_dir = config._tmp_path_factory.getbasetemp().parent  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if "waits" in item.keywords and has_lane(item.config):  # outside the lock (tests/lanes.py)
        _wait_out_serial(item.config)
        yield
        return
    if "background" in item.keywords and is_lane_worker(item.config):
        run_in_the_background()  # the lane's last files, at idle priority (tests/lanes.py)
    with _run_lock(item.config, exclusive="serial" in item.keywords) as locks:
        item.stash[_LOCKS] = locks
        yield


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection(session: pytest.Session):
    run_dir = getattr(session.config, "_serial_lock_dir", None)
    lane = is_lane_worker(session.config)
    if lane:
        collect_after_the_others(run_dir)
    try:
        return (yield)
    finally:
        if not lane:
            collection_ended(run_dir)


def pytest_collection_finish(session: pytest.Session) -> None:
    heap.started()  # what collection imported lives as long as the run: out of the collector's passes


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with a lane for the files whose tests mostly wait (tests/lanes.py)."""
    return LaneScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


class Alone:
    """``with alone():`` runs a block of the test while no other test of the run runs.

    The test's shared hold is given up before the gate is taken (two workers each holding one
    and waiting for the other's would deadlock), then the lock is taken exclusive: the block
    starts once the other workers' current tests end, and no test starts until it is over.

    ``alone.reserve()`` takes the gate at once, for a block that comes after a long set-up: no
    other test starts from then on, and the block waits only for the tests running now, which
    end while the set-up runs. Else the test would wait at the block for the rest of another
    worker's test (a fleet scenario: half a minute) with a core idle."""

    def __init__(self, locks: tuple | None, serial: bool) -> None:
        self.locks = None if serial else locks  # one process, or alone already: nothing to take
        self.reserved = False

    def reserve(self) -> None:
        if self.locks is None or self.reserved:
            return
        gate, run = self.locks
        fcntl.flock(run, fcntl.LOCK_UN)
        fcntl.flock(gate, fcntl.LOCK_EX)
        self.reserved = True

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self.locks is None:
            yield
            return
        gate, run = self.locks
        self.reserve()
        try:
            fcntl.flock(run, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(run, fcntl.LOCK_SH)  # back to the test's shared hold, before the gate opens
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
            self.reserved = False


@pytest.fixture
def alone(request: pytest.FixtureRequest) -> Alone:
    """A block of the test that runs while no other test of the run runs (:class:`Alone`)."""
    return Alone(request.node.stash.get(_LOCKS, None), "serial" in request.node.keywords)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# Seconds each test file took in a recorded run of the whole suite (`make test-durations`): the
# longest files are handed to the pytest-xdist workers first (--dist loadfile, and
# --no-loadscope-reorder, else pytest-xdist hands them out by test count), so that no long
# file starts last and runs on alone while the other workers wait. A file not in the record
# (new since) counts as long as its `slow` tests say.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
SECONDS_PER_SLOW_TEST = 10.0


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Files with a `serial` test first, then the others; each group in order of their recorded
    (else estimated) seconds, longest first; each file's tests kept together and in order.

    A serial test waits for the test the other worker is running to end: early in the run that
    is a short test of another serial file, later it may be a minute-long fleet scenario."""
    recorded = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    seconds: dict[str, float] = {}
    first: dict[str, int] = {}
    has_serial: set[str] = set()
    for index, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        first.setdefault(path, index)
        seconds[path] = seconds.get(path, 0.0) + SECONDS_PER_SLOW_TEST * ("slow" in item.keywords)
        if "serial" in item.keywords:
            has_serial.add(path)
    for path in seconds:
        seconds[path] = recorded.get(path, seconds[path])
    items.sort(key=lambda item: (
        (path := item.nodeid.split("::", 1)[0]) not in has_serial, -seconds[path], first[path]))


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("SHARDLINE_RECORD_FILE_SECONDS"):  # setup, call and teardown all count
        path = report.nodeid.split("::", 1)[0]
        _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get("SHARDLINE_RECORD_FILE_SECONDS")
    if target and _file_seconds and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller sees every report
        ordered = dict(sorted(((k, round(v, 1)) for k, v in _file_seconds.items()), key=lambda kv: -kv[1]))
        Path(target).write_text(json.dumps(ordered, indent=0) + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_files_first(items)
    record_lane_files(getattr(config, "_serial_lock_dir", None), items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA GPUs; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


with contextlib.suppress(ImportError):
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, max_examples=50)
    settings.load_profile("ci")
