"""The autoscaler's decisions on a clock of its own: the window, the thresholds, the cooldown, min/max."""

from __future__ import annotations

from services.fleet.autoscale import Autoscaler
from services.fleet.spec import Autoscaling

POLICY = Autoscaling(min_replicas=1, max_replicas=3, scale_out_threshold=80, scale_in_threshold=35,
                     window_s=10, cooldown_s=30)


def run(samples: list[tuple[float, float]], current: int, scaler: Autoscaler | None = None) -> list[int]:
    scaler = scaler or Autoscaler()
    out = []
    for t, util in samples:
        current = scaler.decide(POLICY, t, util, current).desired
        out.append(current)
    return out


def test_scale_out_needs_the_whole_window_above_the_threshold() -> None:
    ticks = [(float(t), 90.0) for t in range(0, 12, 3)]  # 0, 3, 6, 9: not yet 10 s of samples
    assert run(ticks, 1) == [1, 1, 1, 1]
    assert run([*ticks, (12.0, 90.0)], 1)[-1] == 2


def test_the_windows_mean_decides_not_one_sample() -> None:
    dip = [(0.0, 90.0), (4.0, 70.0), (8.0, 90.0), (12.0, 90.0)]  # mean 85 over the 12 s
    assert run(dip, 1) == [1, 1, 1, 2]
    burst = [(0.0, 10.0), (4.0, 10.0), (8.0, 99.0), (12.0, 99.0)]  # mean 54.5: a burst is not load
    assert run(burst, 1) == [1, 1, 1, 1]


def test_cooldown_after_a_change_and_the_bounds() -> None:
    scaler = Autoscaler()
    hot = [(float(t), 95.0) for t in range(0, 200, 2)]
    counts = run(hot, 1, scaler)
    changes = [hot[i][0] for i in range(1, len(counts)) if counts[i] != counts[i - 1]]
    assert counts[-1] == 3 and len(changes) == 2  # max 3
    assert changes[1] - changes[0] >= POLICY.cooldown_s


def test_scale_in_below_the_lower_threshold_down_to_min() -> None:
    cold = [(float(t), 5.0) for t in range(0, 200, 2)]
    assert run(cold, 3)[-1] == 1
    assert run([(float(t), 50.0) for t in range(0, 200, 2)], 3)[-1] == 3  # between the thresholds: held


def test_no_samples_no_decision() -> None:
    assert Autoscaler().decide(POLICY, 0.0, None, 2).desired == 2
    assert Autoscaler().decide(POLICY, 0.0, None, 5).desired == 3  # but within max
