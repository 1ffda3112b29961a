"""A telemetry process shared by the tests that only ship events to it and read them back."""

from __future__ import annotations

import pytest

from tests.telemetry.procs import start_service


@pytest.fixture(scope="session")
def telemetry(tmp_path_factory):
    service = start_service("telemetry", tmp_path_factory.mktemp("telemetry") / "telemetry.log",
                            "--window-s", "300")
    yield service
    assert service.stop() == 0
