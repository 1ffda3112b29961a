"""Suite-wide fixtures: real PostgreSQL and Redis (started by `make test`, or here on demand)."""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from collections.abc import Iterator

import pytest

from tests import stack
from tests.model_fixtures import smollm2_dir, tiny_model_dir  # noqa: F401  (fixtures for every test)


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


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
