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

# The TP degrees the layout-invariant numerics makes agree: up to one node's accelerators. Each
# further degree multiplies the k-chunks (a 1B-class Llama also allows TP 16 and 32: its o_proj in
# 32 chunks of 64 columns took 1.3-1.45x the time of 8 chunks at 16-512 rows on a 2-core AMD EPYC),
# and a tensor-parallel group rarely spans more than a node (pipeline stages do).
INVARIANT_MAX_TP = 8


def numerics_for(tp_degree: int) -> str:
    """The default numerics of a plan at ``tp_degree`` (one the model allows): layout-invariant up
    to :data:`INVARIANT_MAX_TP`, per-layout above, where a plan must say so."""
    return DEFAULT_NUMERICS if tp_degree <= INVARIANT_MAX_TP else PER_LAYOUT
