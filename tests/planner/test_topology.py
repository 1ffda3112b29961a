"""Topology presets, YAML round trip, validation and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.planner.topology import GIB, PRESETS, Topology, TopologyError, load_topology


def test_a100_preset_is_the_seeds_node() -> None:
    t = PRESETS["a100-80g-8x"]
    assert t.gpus_per_node == 8 and t.nvlink_domain_size == 8
    assert t.gpu_memory_bytes == 80 * GIB
    assert t.intra_node_bandwidth_bytes_per_s == 600e9
    assert t.inter_node_bandwidth_bytes_per_s == 25e9
    assert t.usd_per_gpu_hour == 2.80
    assert t.reserve_bytes == 3 * GIB
    assert set(PRESETS) == {"a100-80g-8x", "h100-80g-8x", "h200-141g-8x"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_round_trip(tmp_path: Path, name: str) -> None:
    path = tmp_path / "t.yaml"
    PRESETS[name].save(path, calibration={"note": "ignored by the planner"})
    assert Topology.load(path) == PRESETS[name]
    assert load_topology(str(path)) == PRESETS[name]


def test_unknown_and_missing_fields_are_named(tmp_path: Path) -> None:
    data = PRESETS["a100-80g-8x"].to_dict()
    data["nvlink_gbps"] = 600
    with pytest.raises(TopologyError, match="unknown field.*nvlink_gbps"):
        Topology.from_dict(data)
    data = PRESETS["a100-80g-8x"].to_dict()
    del data["hbm_bandwidth_bytes_per_s"]
    with pytest.raises(TopologyError, match="missing field.*hbm_bandwidth_bytes_per_s"):
        Topology.from_dict(data)
    with pytest.raises(TopologyError, match="unknown topology 'b200'"):
        load_topology("b200")


def test_validation_names_expected_and_actual() -> None:
    base = PRESETS["a100-80g-8x"]
    with pytest.raises(TopologyError, match="nvlink_domain_size 16 exceeds gpus_per_node 8"):
        base.with_overrides(nvlink_domain_size=16)
    with pytest.raises(TopologyError, match="hbm_bandwidth_bytes_per_s must be a positive number, got 0"):
        base.with_overrides(hbm_bandwidth_bytes_per_s=0)
    with pytest.raises(TopologyError, match="reserve_bytes .* leaves nothing"):
        base.with_overrides(reserve_bytes=base.gpu_memory_bytes)


def test_overrides_keep_the_domain_inside_the_node() -> None:
    t = PRESETS["h100-80g-8x"].with_overrides(gpus_per_node=4, gpu_memory_bytes=40 * GIB, usd_per_gpu_hour=None)
    assert (t.gpus_per_node, t.nvlink_domain_size, t.gpu_memory_bytes) == (4, 4, 40 * GIB)
    assert t.name == "h100-80g-8x+custom"
    assert PRESETS["h100-80g-8x"].with_overrides() is not None
