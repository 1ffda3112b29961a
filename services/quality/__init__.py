"""Quality: whether two plans of a model give the same numbers, and whether a serving group
still does.

- ``golden_set``: the fixed English text both plans are scored on, cut into token chunks;
- ``comparison``: the math of two score sets (perplexity delta with its bootstrap interval,
  top-1 agreement, mean |Δ logprob|), one vocabulary for everything below;
- ``gate``: a plan written ``key=value``, scored as a local replica group or through a serving
  group's Score RPC, and the gate against a threshold, recorded in the registry (what
  ``shardline compare`` / ``gate`` and the fleet controller run);
- ``drift``: a serving group gated against a trusted local plan on a schedule (``shardline drift``);
- ``shadow_window``: the rolling window of a shadow pair's mirrored positions (the router's
  shadow traffic).

Torch-free at import: scoring a local plan spawns worker ranks (the worker layer's runtime,
imported where it is called), so the fleet controller and the CLIs that only score live groups
never load torch. The rank-side scoring (a worker's Score, ``services/worker/scoring.py``) runs
in the worker.
"""
