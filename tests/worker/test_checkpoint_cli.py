"""`score`/`generate` on a pre-sharded checkpoint give exactly what the HF directory gives, and a
checkpoint cut for another layout is refused before any weight is used."""

from __future__ import annotations

import json

import pytest

from tests.cli import run_cli as cli
from tests.worker.oracle import reference_greedy

IDS = ",".join(str(i) for i in range(10, 80))


@pytest.mark.slow
def test_checkpoint_scores_and_generates_like_the_hf_directory(tiny_model_dir, tmp_path):
    out = tmp_path / "shards"
    assert cli("shard", "--model", str(tiny_model_dir), "--tp", "2", "--pp", "2", "--out", str(out)).returncode == 0
    manifest = str(out / "manifest.json")
    from_shards = cli("score", "--checkpoint", manifest, "--tp", "2", "--pp", "2", "--ids", IDS, "--json")
    from_hf = cli("score", "--model", str(tiny_model_dir), "--tp", "2", "--pp", "2", "--ids", IDS, "--json")
    assert from_shards.returncode == 0, from_shards.stderr
    assert json.loads(from_shards.stdout) == json.loads(from_hf.stdout)
    gen = cli("generate", "--checkpoint", manifest, "--model", str(tiny_model_dir), "--tp", "2", "--pp", "2",
              "--prompt-ids", "5,6,7", "--max-tokens", "8", "--ignore-eos", "--json",
              "--collective-timeout", "30")  # four ranks on 2 busy cores miss the 2 s default
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["token_ids"] == reference_greedy(tiny_model_dir, [5, 6, 7], 8)

    wrong = cli("score", "--checkpoint", manifest, "--tp", "4", "--pp", "1", "--ids", IDS, "--json")
    assert wrong.returncode == 1
    assert "ShardLayoutError" in wrong.stderr and "tp_degree: checkpoint has 2, plan needs 4" in wrong.stderr
    assert "Traceback" not in wrong.stderr
