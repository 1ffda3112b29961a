"""How a plan orders its layout-dependent sums (one name for the worker's flag, the plan and the
fleet spec).

``default``: a row-parallel layer's per-rank partial sums are all-reduced in the backend's
order, so each TP degree rounds differently. ``layout-invariant``: every such sum runs over fixed
k-chunks in one fixed order at every TP and PP degree (``services/modeling/parallel/layers.py``),
so every layout of the same weights gives the same bits.
"""

from __future__ import annotations

NUMERICS = ("default", "layout-invariant")
