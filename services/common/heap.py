"""The garbage collector around a process's start-up.

Start-up imports torch, gRPC, transformers and the service's own modules: a heap of objects that
live as long as the process. While that heap grows, the collector's full passes walk it again and
again (4 full passes, 0.25 s of the 2.8 s a worker's imports take on a 2-core AMD EPYC), and once
the process serves, every later full pass walks it once more, for nothing: in the test suite's
serving processes a tenth of their CPU went to the collector.

So a process defers full passes while it starts (:func:`starting`; the young generations are
still collected, so the short-lived cycles of start-up are freed as before), and once it serves
(:func:`started`) collects once and freezes what is left: start-up's objects leave every later
pass, and the collector goes back to its usual thresholds for what serving allocates.
"""

from __future__ import annotations

import gc

USUAL_THRESHOLDS = gc.get_threshold()
# a full pass is considered after this many collections of the middle generation instead of 10:
# about 7 million net allocations, more than any start-up makes, few enough that a process that
# never calls started() (a command that runs and exits) still collects its old cycles
STARTUP_FULL_THRESHOLD = 1000


def starting() -> None:
    """Full collections wait until :func:`started` (or ~7 million net allocations)."""
    young, middle, _ = USUAL_THRESHOLDS
    gc.set_threshold(young, middle, STARTUP_FULL_THRESHOLD)


def started() -> None:
    """Start-up is over: its garbage collected once, what it keeps frozen out of later passes."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*USUAL_THRESHOLDS)
