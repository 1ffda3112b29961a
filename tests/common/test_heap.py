"""The garbage collector around start-up (services/common/heap.py)."""

from __future__ import annotations

import gc

import pytest

from services.common import heap

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


def test_starting_defers_full_collections_and_started_freezes_and_restores_the_thresholds() -> None:
    heap.starting()
    young, middle, full = gc.get_threshold()
    assert (young, middle) == heap.USUAL_THRESHOLDS[:2] and full == heap.STARTUP_FULL_THRESHOLD
    frozen = gc.get_freeze_count()
    kept = [[i] for i in range(1000)]  # start-up's objects: tracked containers that live on
    heap.started()
    assert gc.get_threshold() == heap.USUAL_THRESHOLDS
    assert gc.get_freeze_count() >= frozen + len(kept)
