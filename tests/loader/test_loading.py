"""Ranks loaded from shards are bitwise the ranks loaded from the HF directory, and score the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.loader.errors import ShardLayoutError
from services.loader.layout import model_fingerprint, rank_model
from services.loader.manifest import Manifest
from services.worker.launch import run_replica_group
from services.worker.rank_loading import load_checkpoint_weights, load_rank_shard, plan_for_checkpoint
from services.worker.runtime import RankSpec
from services.worker.scoring import score_rank
from tests.loader.helpers import hf_rank, plan_of, score_from_checkpoint_rank, state_dict_diffs

TOKEN_IDS = [1, 17, 300, 42, 9, 511, 256, 3, 77, 128]


@pytest.mark.parametrize("which, tp, pp, dtype", [
    ("tiny", 2, 2, None), ("tiny", 4, 1, None), ("tied", 1, 1, None), ("tied", 2, 2, None),
    ("bf16", 2, 1, None), ("tiny", 2, 1, "bfloat16"),
])
def test_shard_loaded_ranks_are_bitwise_the_hf_loaded_ranks(request: pytest.FixtureRequest, sharded, which: str,
                                                            tp: int, pp: int, dtype: str | None) -> None:
    model_dir: Path = request.getfixturevalue(f"{which}_dir")
    ckpt = sharded(model_dir, tp, pp, dtype)
    plan = plan_for_checkpoint(ckpt / "manifest.json", tp_degree=tp, pp_degree=pp)
    assert plan == plan_of(model_dir, tp, pp, dtype or plan.config.torch_dtype)
    fingerprint = model_fingerprint(model_dir)
    for rank in range(plan.world_size):
        from_shard = rank_model(plan, rank, device="cpu")
        loaded = load_checkpoint_weights(from_shard, plan, rank, ckpt / "manifest.json",
                                         expected_fingerprint=fingerprint)
        assert loaded == sum(p.numel() * p.element_size() for p in from_shard.parameters())
        assert state_dict_diffs(from_shard, hf_rank(model_dir, plan, rank)) == [], f"rank {rank}"


def test_tied_lm_head_still_shares_the_embedding_after_loading(tied_dir: Path, sharded) -> None:
    ckpt = sharded(tied_dir, 2, 1)
    plan = plan_of(tied_dir, 2, 1)
    model = rank_model(plan, 1, device="cpu")
    load_checkpoint_weights(model, plan, 1, ckpt)  # a directory URI finds its manifest.json
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_load_rank_shard_directly(tiny_dir: Path, sharded) -> None:
    ckpt = sharded(tiny_dir, 4, 1)
    manifest = Manifest.load(ckpt / "manifest.json")
    plan = plan_of(tiny_dir, 4, 1)
    model = rank_model(plan, 3, device="cpu")
    load_rank_shard(model, manifest, ckpt / "model-tp03-pp00.safetensors", plan, 3)
    assert state_dict_diffs(model, hf_rank(tiny_dir, plan, 3)) == []
    with pytest.raises(ShardLayoutError, match="manifest says .* for model-tp02-pp00.safetensors; its header says "
                                               "tp_rank '3' \\(expected '2'\\)"):
        load_rank_shard(rank_model(plan, 2, device="cpu"), manifest, ckpt / "model-tp03-pp00.safetensors", plan, 2)


@pytest.mark.parametrize("tp, pp", [(2, 2), (4, 1)])
def test_scores_are_identical(tiny_dir: Path, sharded, tmp_path: Path, tp: int, pp: int) -> None:
    ckpt = sharded(tiny_dir, tp, pp)
    spec = RankSpec(str(tiny_dir), tp_degree=tp, pp_degree=pp, dtype="float32", collective_timeout_s=10.0)
    from_hf = run_replica_group(tp * pp, score_rank, spec, TOKEN_IDS, failure_grace_s=15.0)
    from_ckpt = run_replica_group(tp * pp, score_from_checkpoint_rank, str(ckpt / "manifest.json"), tp, pp,
                                  str(tmp_path / "cache"), TOKEN_IDS, failure_grace_s=15.0)
    assert from_ckpt.logprobs == from_hf.logprobs
    assert from_ckpt.n_tokens == len(TOKEN_IDS) and from_ckpt.nll == from_hf.nll
