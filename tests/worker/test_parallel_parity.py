"""Sharded outputs equal the unsharded model (transformers) at every TP/PP the model allows."""

from __future__ import annotations

import pytest
import torch

from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec
from services.worker.scoring import score_rank
from tests.cli import run_cli
from tests.ranks import NUMERICS_COLLECTIVE_TIMEOUT_S
from tests.worker.oracle import reference_logprobs

TINY_LAYOUTS = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)]  # every TP·PP ≤ 4 in {1,2,4}²


def sharded_logprobs(model_dir, ids, tp, pp, dtype="float32"):
    spec = RankSpec(str(model_dir), tp_degree=tp, pp_degree=pp, dtype=dtype,
                    collective_timeout_s=NUMERICS_COLLECTIVE_TIMEOUT_S)
    result = run_replica_group(tp * pp, score_rank, spec, ids)
    return torch.tensor(result.logprobs), result


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def make_tiny(out, *flags: str) -> str:
    made = run_cli("model", "tiny", "--out", str(out), *flags)
    assert made.returncode == 0, made.stderr
    return str(out)


@pytest.mark.parametrize(("tp", "pp"), TINY_LAYOUTS)
def test_tiny_float32_matches_transformers(tiny_model_dir, tp, pp):
    ids = random_ids(80, 512)
    ours, result = sharded_logprobs(tiny_model_dir, ids, tp, pp)
    ref = reference_logprobs(tiny_model_dir, ids)
    assert result.n_tokens == 80 and ours.shape == (79,)
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_tiny_bfloat16_matches_transformers_bfloat16(tmp_path_factory, tp, pp):
    model_dir = make_tiny(tmp_path_factory.mktemp("tiny-bf16"), "--dtype", "bfloat16")
    ids = random_ids(72, 512, seed=1)
    ours, _ = sharded_logprobs(model_dir, ids, tp, pp, dtype="bfloat16")
    ref = reference_logprobs(model_dir, ids, dtype="bfloat16")
    assert (ours - ref).abs().max().item() <= 5e-2


def test_llama3_rope_scaling_matches_transformers(tmp_path_factory):
    model_dir = make_tiny(tmp_path_factory.mktemp("tiny-llama3"), "--rope-scaling", "llama3",
                          "--tie-embeddings")
    ids = random_ids(96, 512, seed=2)
    ref = reference_logprobs(model_dir, ids)
    for tp, pp in [(1, 1), (2, 2)]:
        ours, _ = sharded_logprobs(model_dir, ids, tp, pp)
        assert (ours - ref).abs().max().item() <= 1e-4, (tp, pp)


ENGLISH = (
    "The river runs through the middle of the old town, and on summer evenings people walk along "
    "its banks to watch the boats come in. Most of the houses near the water were built more than "
    "two hundred years ago, when the town was a busy port. Today the harbour is quiet, but the "
    "market still opens every Saturday morning, and farmers from the nearby villages sell bread, "
    "cheese, fruit and vegetables to visitors from all over the country."
)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (3, 1), (1, 2), (3, 2)])
def test_smollm2_matches_transformers(smollm2_dir, tp, pp):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(f"{smollm2_dir}/tokenizer.json").encode(ENGLISH).ids
    assert len(ids) >= 64
    ours, result = sharded_logprobs(smollm2_dir, ids, tp, pp)
    ref = reference_logprobs(smollm2_dir, ids)
    assert (ours - ref).abs().max().item() <= 1e-3
    assert result.perplexity < 30, result.perplexity
