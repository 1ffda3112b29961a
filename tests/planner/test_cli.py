"""`shardline plan`, `plan capacity`: through main() and once through the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.cli import main

REPO = Path(__file__).resolve().parents[2]
CAPACITY_ARGS = ["plan", "capacity", "--model", "llama3-70b", "--tp", "4", "--pp", "2", "--req-per-s", "400",
                 "--output-tokens", "300", "--seq-tokens-per-s", "40"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_has_the_done_when_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--model", "llama3-70b", "--topology", "a100-80g-8x", "--dtype", "fp16",
                       "--kv-cap-gb", "20", "--avg-context", "2048", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert abs(data["model"]["parameters"] - 70.55e9) < 0.01e9
    assert data["model"]["kv_bytes_per_token"] == 327_680
    (c,) = [c for c in data["candidates"] if c["tp"] == 4 and c["pp"] == 2]
    assert (c["kv_bytes_per_token_per_gpu"], c["kv_tokens_per_gpu"], c["max_concurrent_sequences"]) == (
        40_960, 524_288, 256)
    required = {"tp", "pp", "dtype", "gpus", "feasible", "rejected_reason", "weight_bytes_per_gpu",
                "kv_bytes_per_token_per_gpu", "kv_tokens_per_gpu", "max_concurrent_sequences", "replicas_per_node",
                "predicted_tpot_ms", "tokens_per_s_per_replica", "usd_per_million_tokens", "bubble_fraction"}
    for candidate in [data["chosen"], *data["candidates"]]:
        assert required <= set(candidate)


def test_capacity_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *CAPACITY_ARGS, "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert data["tokens_per_s_per_replica"] == 10_240
    assert data["replicas"] == 12
    assert data["nodes"] == 12
    assert data["plan"]["max_concurrent_sequences"] == 256
    assert data["autoscaling"] == {"min_replicas": 4, "max_replicas": 24, "scale_on": "kv_cache_utilization_pct",
                                   "scale_out_threshold": 80, "scale_in_threshold": 35}


def test_capacity_through_the_real_entry_point() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "services.cli", *CAPACITY_ARGS, "--format", "json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["tokens_per_s_per_replica"], data["replicas"]) == (10_240, 12)


def test_capacity_yaml_is_the_seeds_shard_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *CAPACITY_ARGS, "--format", "yaml")
    assert code == 0
    plan = yaml.safe_load(out)
    assert plan["replica_group"] == {
        "name": "llama3-70b-fp16-primary",
        "tp_degree": 4,
        "pp_degree": 2,
        "dtype": "float16",
        "gpus_per_replica": 8,
        "nvlink_domain": "node-local",
        "kv_cache_cap_gb": 20,
        "max_concurrent_sequences": 256,
        "checkpoint": {
            "manifest_uri": "s3://models/llama3-70b/fp16/manifest.json",
            "shard_prefix": "model-tp{tp_rank:02d}-pp{pp_stage:02d}.safetensors",
        },
    }
    assert plan["autoscaling"] == {"min_replicas": 4, "max_replicas": 24, "scale_on": "kv_cache_utilization_pct",
                                   "scale_out_threshold": 80, "scale_in_threshold": 35}


def test_capacity_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *CAPACITY_ARGS)
    assert code == 0
    assert "256 sequences × 40.00 tok/s (TPOT 25.00 ms, given) = 10,240 tok/s" in out
    assert "replicas      ⌈11.72⌉ = 12" in out
    assert "fleet         12 node(s), 96 GPUs" in out


def test_plan_table_and_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--model", "llama3-70b")
    assert code == 0
    assert "70.55e9 parameters (70,553,706,496)" in out
    assert "KV 327,680 B/token unsharded (float16)" in out
    assert "\nChosen: TP8/PP1 float16 — " in out and "Why the others lost:" in out
    assert "TP1/PP1 float16: rejected: out of memory" in out
    code, out, _ = run(capsys, "plan", "--model", "llama3-70b", "--tp", "4", "--pp", "2", "--format", "yaml")
    assert code == 0
    plan = yaml.safe_load(out)
    assert (plan["replica_group"]["tp_degree"], plan["replica_group"]["pp_degree"]) == (4, 2)
    assert plan["predicted"]["kv_tokens_per_gpu"] == 524_288


def test_config_json_and_topology_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "hidden_size": 576,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
        "tie_word_embeddings": True}))
    from services.planner.topology import PRESETS

    topo = tmp_path / "topo.yaml"
    PRESETS["h100-80g-8x"].with_overrides(gpus_per_node=4, name="h100-4x").save(topo)
    code, out, err = run(capsys, "plan", "--config", str(tmp_path / "config.json"), "--topology", str(topo),
                         "--dtype", "fp32", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["model"]["parameters"] == 134_515_008
    assert data["topology"]["name"] == "h100-4x"
    assert {c["tp"] for c in data["candidates"]} == {1, 3}


def test_infeasible_405b_exits_nonzero_with_the_closest_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--model", "llama3.1-405b", "--dtype", "fp16")
    assert code == 1 and out == ""
    assert err.startswith("shardline plan: error: no shard plan fits llama3.1-405b at float16 on a100-80g-8x")
    assert "Closest: TP4/PP2 float16 (8 GPUs)" in err and "short by 40,263,188,480 B (37.50 GiB) per GPU" in err


def test_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "--model", "llama3-70b", "--dtype", "fp4")
    assert code == 1 and "unknown dtype 'fp4'" in err
    code, _, err = run(capsys, "plan")
    assert code == 1 and "a model is required" in err
    code, _, err = run(capsys, "plan", "--model", "llama3-70b", "--topology", "nope")
    assert code == 1 and "unknown topology 'nope'" in err
