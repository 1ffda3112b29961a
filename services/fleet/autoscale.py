"""Scale a fleet on its KV-cache utilization: out above one threshold, in below another.

The input is the mean KV utilization of the groups in rotation, sampled every controller tick.
A decision takes the mean of those samples over the whole window (``window_s``): above the
scale-out threshold adds a group, below the scale-in threshold removes one; none is taken before
the samples span the window, nor within ``cooldown_s`` of the last one (or of the fleet's last
change of size), so a burst neither adds a group nor a lull removes one. One group at a time,
within min/max.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.fleet.spec import Autoscaling


@dataclass(frozen=True)
class ScaleDecision:
    desired: int
    utilization_pct: float | None  # the window's mean, None before there is a window
    reason: str  # why desired moved, empty when it did not


class Autoscaler:
    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque()  # (time, utilization %)
        self._last_change = float("-inf")

    def reset(self, now: float) -> None:
        """Forget the window and start the cooldown (the fleet changed: a rollout, a heal)."""
        self._samples.clear()
        self._last_change = now

    def decide(self, policy: Autoscaling, now: float, utilization_pct: float | None, current: int) -> ScaleDecision:
        desired = max(policy.min_replicas, min(policy.max_replicas, current))
        if utilization_pct is not None:
            self._samples.append((now, utilization_pct))
        # keep the newest sample from before the window too: the samples then span the whole window
        while len(self._samples) > 1 and now - self._samples[1][0] >= policy.window_s:
            self._samples.popleft()
        if not self._samples:
            return ScaleDecision(desired, None, "")
        values = [u for _, u in self._samples]
        mean = sum(values) / len(values)
        if desired != current:
            return ScaleDecision(desired, mean, f"held within min {policy.min_replicas} .. max {policy.max_replicas}")
        spans_window = now - self._samples[0][0] >= policy.window_s
        if not spans_window or now - self._last_change < policy.cooldown_s:
            return ScaleDecision(desired, mean, "")
        if mean > policy.scale_out_threshold and desired < policy.max_replicas:
            self.reset(now)
            return ScaleDecision(desired + 1, mean, f"KV utilization {mean:.1f} % > "
                                                    f"{policy.scale_out_threshold:g} % for {policy.window_s:g} s")
        if mean < policy.scale_in_threshold and desired > policy.min_replicas:
            self.reset(now)
            return ScaleDecision(desired - 1, mean, f"KV utilization {mean:.1f} % < "
                                                    f"{policy.scale_in_threshold:g} % for {policy.window_s:g} s")
        return ScaleDecision(desired, mean, "")
