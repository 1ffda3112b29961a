"""The S3 path end to end against a real S3-API server (moto): shard → verify → stage → load → score."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main as cli_main
from services.loader.errors import ShardChecksumError
from services.loader.layout import rank_model
from services.loader.object_store import open_store
from services.loader.staging import stage
from services.worker.launch import run_replica_group
from services.worker.rank_loading import load_checkpoint_weights, plan_for_checkpoint
from services.worker.runtime import RankSpec
from services.worker.scoring import score_rank
from tests.loader.helpers import hf_rank, score_from_checkpoint_rank, state_dict_diffs
from tests.loader.test_loading import TOKEN_IDS


@pytest.mark.slow
def test_shard_to_s3_stage_load_and_score(tiny_dir: Path, s3_bucket: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    prefix = f"s3://{s3_bucket}/llama/tiny/fp32-tp2-pp2"
    assert cli_main(["shard", "--model", str(tiny_dir), "--tp", "2", "--pp", "2", "--out", prefix, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    store = open_store(prefix)
    assert store.list() == sorted(["manifest.json", "config.json", "generation_config.json"]
                                  + [s["file"] for s in summary["shards"]])
    assert cli_main(["verify", "--manifest", f"{prefix}/manifest.json", "--tp", "2", "--pp", "2"]) == 0
    assert "verified 4 shard(s)" in capsys.readouterr().out

    cache = tmp_path / "cache"
    staged = stage(f"{prefix}/manifest.json", 1, 1, cache_dir=cache)
    assert (staged.cache_hit, staged.attempts) == (False, 1)
    assert stage(f"{prefix}/manifest.json", 1, 1, cache_dir=cache).cache_hit

    plan = plan_for_checkpoint(f"{prefix}/manifest.json", tp_degree=2, pp_degree=2)
    for rank in range(plan.world_size):
        model = rank_model(plan, rank, device="cpu")
        load_checkpoint_weights(model, plan, rank, f"{prefix}/manifest.json", cache_dir=cache)
        assert state_dict_diffs(model, hf_rank(tiny_dir, plan, rank)) == []

    spec = RankSpec(str(tiny_dir), tp_degree=2, pp_degree=2, dtype="float32", collective_timeout_s=10.0)
    from_hf = run_replica_group(4, score_rank, spec, TOKEN_IDS, failure_grace_s=15.0)
    from_s3 = run_replica_group(4, score_from_checkpoint_rank, f"{prefix}/manifest.json", 2, 2,
                                str(tmp_path / "rank-cache"), TOKEN_IDS, failure_grace_s=15.0)
    assert from_s3.logprobs == from_hf.logprobs


def test_corrupt_object_in_s3_fails_after_three_downloads(tiny_dir: Path, sharded, s3_bucket: str,
                                                          tmp_path: Path) -> None:
    ckpt = sharded(tiny_dir, 4, 1)
    store = open_store(f"s3://{s3_bucket}/ckpt")
    for path in ckpt.iterdir():
        store.put_file(path.name, path)
    damaged = bytearray((ckpt / "model-tp02-pp00.safetensors").read_bytes())
    damaged[-1] ^= 0x80
    store.put_bytes("model-tp02-pp00.safetensors", bytes(damaged))
    with pytest.raises(ShardChecksumError, match="s3://.*/ckpt/model-tp02-pp00.safetensors: still wrong "
                                                 "after 3 download attempt"):
        stage(f"s3://{s3_bucket}/ckpt/manifest.json", 2, 0, cache_dir=tmp_path / "cache")
    assert stage(f"s3://{s3_bucket}/ckpt", 1, 0, cache_dir=tmp_path / "cache").attempts == 1
