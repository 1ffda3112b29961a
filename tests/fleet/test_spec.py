"""The fleet spec: the shard-plan.yaml shape parsed, checked field by field, and round-tripped."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main
from services.fleet.provisioner import GroupLaunch
from services.fleet.spec import FleetSpec, InvalidFleetSpec

SEED_SHAPE = """
replica_group:
  name: llama3-70b-fp16-primary
  tp_degree: 4
  pp_degree: 2
  dtype: fp16
  gpus_per_replica: 8
  nvlink_domain: node-local
  kv_cache_cap_gb: 20
  max_concurrent_sequences: 256
  checkpoint:
    manifest_uri: s3://models/llama3-70b/fp16/manifest.json
    shard_prefix: "model-tp{tp_rank:02d}-pp{pp_stage:02d}.safetensors"
autoscaling:
  min_replicas: 4
  max_replicas: 24
  scale_on: kv_cache_utilization_pct
  scale_out_threshold: 80
  scale_in_threshold: 35
"""


def test_the_seed_shape_parses_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(SEED_SHAPE)
    spec = FleetSpec.load(path)
    g = spec.group
    assert (spec.name, g.tp_degree, g.pp_degree, g.dtype, g.world_size) == ("llama3-70b-fp16-primary", 4, 2,
                                                                             "float16", 8)
    assert g.manifest_uri == "s3://models/llama3-70b/fp16/manifest.json" and g.kv_cache_cap_gb == 20.0
    assert spec.autoscaling is not None and spec.replicas == 4  # the starting count is within min/max
    assert FleetSpec.from_json(spec.to_json()) == spec
    assert g.collective_timeout_s is None  # the worker's default


def test_the_collective_timeout_reaches_the_workers_flags() -> None:
    spec = FleetSpec.from_dict({"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"},
                                                  "collective_timeout_s": 10}})
    assert FleetSpec.from_json(spec.to_json()) == spec
    flags = GroupLaunch("smol-abc123", "smol", 1, spec.group).worker_flags()
    assert flags[flags.index("--collective-timeout") + 1] == "10"
    with pytest.raises(InvalidFleetSpec, match="collective_timeout_s"):
        FleetSpec.from_dict({"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"},
                                               "collective_timeout_s": 0}})


def test_prefix_caching_is_on_unless_the_spec_turns_it_off() -> None:
    on = FleetSpec.from_dict({"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"}}})
    assert on.group.prefix_caching and "--no-prefix-caching" not in GroupLaunch("smol-1", "smol", 1, on.group) \
        .worker_flags()
    off = FleetSpec.from_dict({"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"},
                                                 "prefix_caching": False}})
    assert FleetSpec.from_json(off.to_json()) == off and off.plan_key() != on.plan_key()
    assert "--no-prefix-caching" in GroupLaunch("smol-1", "smol", 1, off.group).worker_flags()
    with pytest.raises(InvalidFleetSpec, match="prefix_caching must be bool"):
        FleetSpec.from_dict({"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"},
                                               "prefix_caching": "no"}})


def test_the_numerics_reach_the_workers_flags_and_tell_two_plans_apart() -> None:
    default = FleetSpec.from_dict({"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"}}})
    per_layout = FleetSpec.from_dict({"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"},
                                                        "numerics": "per-layout"}})
    assert default.group.numerics == "layout-invariant"
    assert "--numerics" not in GroupLaunch("smol-1", "smol", 1, default.group).worker_flags()
    flags = GroupLaunch("smol-1", "smol", 1, per_layout.group).worker_flags()
    assert flags[flags.index("--numerics") + 1] == "per-layout"
    assert FleetSpec.from_json(per_layout.to_json()) == per_layout and per_layout.plan_key() != default.plan_key()
    assert per_layout.group.describe() == "TP1 x PP1 bfloat16 per-layout"
    assert default.group.describe() == "TP1 x PP1 bfloat16"
    with pytest.raises(InvalidFleetSpec, match="numerics must be one of layout-invariant, per-layout"):
        FleetSpec.from_dict({"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"},
                                               "numerics": "default"}})


def test_a_relative_model_dir_is_the_yaml_folders(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("replica_group: {name: smol, checkpoint: {model_dir: models/smol}}\nreplicas: 2\n")
    spec = FleetSpec.load(path)
    assert spec.group.model_dir == str((tmp_path / "models" / "smol").resolve()) and spec.replicas == 2


def test_plan_key_separates_a_rollout_from_a_resize() -> None:
    base = {"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"}}, "replicas": 2}
    spec = FleetSpec.from_dict(base)
    resized = FleetSpec.from_dict({**base, "replicas": 3})
    assert resized.plan_key() == spec.plan_key()
    for change in ({"pp_degree": 2}, {"dtype": "int8"}, {"env": {"X": "1"}}, {"checkpoint": {"model_dir": "/n"}},
                   {"collective_timeout_s": 10}):
        other = FleetSpec.from_dict({**base, "replica_group": {**base["replica_group"], **change}})
        assert other.plan_key() != spec.plan_key(), change


@pytest.mark.parametrize(("change", "message"), [
    ({"replica_group": {"name": "Not_A_Label", "checkpoint": {"model_dir": "/m"}}}, "DNS label"),
    ({"replica_group": {"name": "a", "checkpoint": {}}}, "exactly one of manifest_uri and model_dir"),
    ({"replica_group": {"name": "a", "tp_degree": 0, "checkpoint": {"model_dir": "/m"}}}, "must be >= 1"),
    ({"replica_group": {"name": "a", "dtype": "fp4", "checkpoint": {"model_dir": "/m"}}}, "replica_group.dtype"),
    ({"replica_group": {"name": "a", "colour": "red", "checkpoint": {"model_dir": "/m"}}}, "unknown field"),
    ({"replica_group": {"name": "a", "tp_degree": "2", "checkpoint": {"model_dir": "/m"}}}, "must be int"),
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas <= max_replicas"),
    ({"autoscaling": {"scale_in_threshold": 90}}, "scale_in_threshold < scale_out_threshold"),
    ({"autoscaling": {"scale_on": "qps"}}, "scale_on"),
    ({"rollout": {"max_surge": 0, "max_unavailable": 0}}, "not both 0"),
    ({"rollout": {"gate": {"chunks": 0}}}, "chunks must be >= 1"),
    ({"replicas": -1}, "replicas must be >= 0"),
    ({"replicaz": 2}, "unknown field"),
])
def test_a_bad_spec_names_its_field(change: dict, message: str) -> None:
    data = {"replica_group": {"name": "smol", "checkpoint": {"model_dir": "/m"}}, **change}
    with pytest.raises(InvalidFleetSpec, match=message):
        FleetSpec.from_dict(data)


def test_apply_cli_refuses_a_bad_file_and_reports_revisions(tmp_path: Path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    bad = tmp_path / "bad.yaml"
    bad.write_text("replica_group: [1, 2]\n")
    assert main(["apply", "-f", str(bad), "--registry-url", url]) == 2
    good = tmp_path / "fleet.yaml"
    good.write_text("replica_group: {name: smol, checkpoint: {model_dir: /m}}\nreplicas: 2\n")
    assert main(["apply", "-f", str(good), "--registry-url", url]) == 0
    assert main(["apply", "-f", str(good), "--registry-url", url]) == 0
    good.write_text("replica_group: {name: smol, pp_degree: 2, checkpoint: {model_dir: /m}}\nreplicas: 2\n")
    assert main(["apply", "-f", str(good), "--registry-url", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fleet smol: revision 1 (applied; new fleet")
    assert out[1].startswith("fleet smol: revision 1 (already the newest")
    assert "revision 2 (applied; a rollout from TP1 x PP1 bfloat16 to TP1 x PP2 bfloat16)" in out[2]
    assert main(["fleet", "status", "--fleet", "smol", "--registry-url", url]) == 0
    assert main(["rollout", "status", "--fleet", "smol", "--registry-url", url]) == 1  # no controller ran yet
