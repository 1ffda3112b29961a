"""The test suite. Importing it (conftest, ``python -m tests.stack``) sets one process default.

OpenMP threads wait passively in the suite (``OMP_WAIT_POLICY=PASSIVE``, inherited by every
process a test starts, unless the environment already says otherwise). The suite runs two
pytest-xdist workers and their stacks of worker, router and rank processes on two cores, always
oversubscribed, where a team thread that spins while a peer is descheduled holds every parallel
region of that step up: a tiny model's steps took ~300 ms instead of 1 ms next to a busy core.
Served on its own cores, a worker keeps libgomp's default (spinning), the faster choice there
(``bench/results/serving.md``). libgomp reads the variable when it loads, so it is set before
anything imports torch.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
