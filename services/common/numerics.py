"""How a plan orders its layout-dependent sums (one name for the worker's flag, the plan, the fleet
spec and the registry).

``layout-invariant`` (the default): every such sum runs over fixed k-chunks in one fixed order at
every TP degree up to 8 the model allows and at every PP degree
(``services/modeling/parallel/layers.py``), so every such layout of the same weights gives the same
bits: a re-shard is gated by equality, and a stream continues on a group of another layout with
the tokens and logprobs it would have had. ``per-layout``: a row-parallel layer's per-rank
partial sums are all-reduced in the backend's order, so each TP degree rounds differently (what
other engines do; needed above TP 8).
"""

from __future__ import annotations

LAYOUT_INVARIANT = "layout-invariant"
PER_LAYOUT = "per-layout"
NUMERICS = (LAYOUT_INVARIANT, PER_LAYOUT)
DEFAULT_NUMERICS = LAYOUT_INVARIANT
