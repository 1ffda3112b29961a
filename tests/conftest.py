"""Suite-wide fixtures: real PostgreSQL and Redis (started by `make test`, or here on demand)."""

from __future__ import annotations

import contextlib
import os
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


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis: the one `make test` started, else a fresh one for this session."""
    url = os.environ.get("SHARDLINE_TEST_REDIS_URL")
    if url:
        yield url
        return
    with stack.redis() as started:
        yield started


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
