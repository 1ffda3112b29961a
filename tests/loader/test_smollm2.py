"""SmolLM2-135M (a real trained model, tied embeddings, 9 heads / 3 KV heads) at TP3/PP2: every
rank loaded from its shard is bitwise the rank loaded from the HF directory, and the model scores
identically — tokenized with the tokenizer the checkpoint carries."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.loader.layout import model_fingerprint, rank_model
from services.loader.manifest import Manifest
from services.loader.staging import stage_model_files
from services.loader.writer import ShardJob, write_shards
from services.worker.launch import run_replica_group
from services.worker.rank_loading import load_checkpoint_weights, plan_for_checkpoint
from services.worker.runtime import RankSpec
from services.worker.scoring import score_rank
from tests.loader.helpers import hf_rank, plan_of, score_from_checkpoint_rank, state_dict_diffs

pytestmark = pytest.mark.slow

TP, PP = 3, 2
TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."


@pytest.fixture(scope="module")
def smollm2_ckpt(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-tp3-pp2")
    write_shards(ShardJob(smollm2_dir, TP, PP, str(out)), progress=False)
    return out


def test_smollm2_tp3_pp2_ranks_are_bitwise_the_hf_loaded_ranks(smollm2_dir: Path, smollm2_ckpt: Path) -> None:
    manifest = Manifest.load(smollm2_ckpt / "manifest.json")
    assert (manifest.plan.tp_degree, manifest.plan.pp_degree, len(manifest.shards)) == (TP, PP, TP * PP)
    plan = plan_for_checkpoint(smollm2_ckpt, tp_degree=TP, pp_degree=PP)
    assert plan == plan_of(smollm2_dir, TP, PP, plan.config.torch_dtype)
    assert plan.config.tie_word_embeddings
    fingerprint = model_fingerprint(smollm2_dir)
    for rank in range(plan.world_size):
        from_shard = rank_model(plan, rank, device="cpu")
        loaded = load_checkpoint_weights(from_shard, plan, rank, smollm2_ckpt / "manifest.json",
                                         expected_fingerprint=fingerprint)
        assert loaded == sum(p.numel() * p.element_size() for p in from_shard.parameters())
        assert state_dict_diffs(from_shard, hf_rank(smollm2_dir, plan, rank)) == [], f"rank {rank}"
        del from_shard


def test_smollm2_tp3_pp2_scores_identically(smollm2_dir: Path, smollm2_ckpt: Path, tmp_path: Path) -> None:
    tokenizer_dir = stage_model_files(smollm2_ckpt / "manifest.json")
    assert tokenizer_dir is not None
    ids = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(TEXT).ids
    assert ids == Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).encode(TEXT).ids
    assert len(ids) > 10

    spec = RankSpec(str(smollm2_dir), tp_degree=TP, pp_degree=PP, dtype="float32", collective_timeout_s=30.0)
    from_hf = run_replica_group(TP * PP, score_rank, spec, ids, failure_grace_s=30.0)
    from_ckpt = run_replica_group(TP * PP, score_from_checkpoint_rank, str(smollm2_ckpt / "manifest.json"), TP, PP,
                                  str(tmp_path / "cache"), ids, failure_grace_s=30.0)
    assert from_ckpt.n_tokens == len(ids)
    assert from_ckpt.logprobs == from_hf.logprobs
    assert from_ckpt.nll == from_hf.nll
    # a trained model on plain English: far better than uniform over 49,152 tokens (ln V ≈ 10.8)
    assert from_ckpt.nll < 3.0
