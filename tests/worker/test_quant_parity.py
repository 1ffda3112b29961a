"""Quantized plans through real worker processes: a TP=3 (and TP=3 x PP=2) int8/fp8 group scores
a sequence as the TP=1 group does, because every rank holds the TP=1 quantized values (float32
activations, so the only differences left are the all-reduce's summation order, and for int8 what
that order does to the activations' rounding)."""

from __future__ import annotations

import pytest
import torch

from services.modeling.tiny import TinyModelSpec, write_tiny_model
from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec
from services.worker.scoring import score_rank
from tests.ranks import NUMERICS_COLLECTIVE_TIMEOUT_S
from tests.worker.test_parallel_parity import random_ids

# divides TP 3 (6 heads, 3 KV heads, intermediate 384, vocab 384) and PP 2 (2 layers)
pytestmark = pytest.mark.slow  # about 10 s a test: real worker processes

TP3_SPEC = TinyModelSpec(layers=2, hidden=192, heads=6, kv_heads=3, intermediate=384, vocab=384, seed=5)


@pytest.fixture(scope="module")
def tp3_model_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny-tp3")
    write_tiny_model(TP3_SPEC, out)
    return str(out)


def logprobs(model_dir: str, ids: list[int], tp: int, pp: int, dtype: str, activation: str | None) -> torch.Tensor:
    spec = RankSpec(model_dir, tp_degree=tp, pp_degree=pp, dtype=dtype, activation_dtype=activation,
                    collective_timeout_s=NUMERICS_COLLECTIVE_TIMEOUT_S)
    assert spec.plan.weight_quant is not None or dtype not in ("int8", "fp8")
    return torch.tensor(run_replica_group(tp * pp, score_rank, spec, ids).logprobs)


# int8 quantizes the activations too (W8A8): where the all-reduce's order moves a value by an ulp
# across a rounding boundary, its int8 value moves by a whole step (1/127 of its group's largest)
# (measured on TP3_SPEC: int8 max 2.7e-3, mean 5.8e-5 at TP3 and TP3 x PP2; fp8 max 4.8e-7)
BOUNDS = {"fp8": (1e-4, 1e-4), "int8": (1e-2, 5e-4)}  # max and mean |Δ logprob| against TP=1


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_tp3_and_pp2_quantized_groups_score_as_tp1(tp3_model_dir, dtype):
    ids = random_ids(48, TP3_SPEC.vocab, seed=4)
    one = logprobs(tp3_model_dir, ids, 1, 1, dtype, "float32")
    for tp, pp in [(3, 1), (3, 2)]:
        delta = (logprobs(tp3_model_dir, ids, tp, pp, dtype, "float32") - one).abs()
        assert delta.max().item() <= BOUNDS[dtype][0] and delta.mean().item() <= BOUNDS[dtype][1]


def test_int8_bfloat16_scores_near_the_bfloat16_plan(tp3_model_dir):
    ids = random_ids(48, TP3_SPEC.vocab, seed=6)
    dense = logprobs(tp3_model_dir, ids, 1, 1, "bfloat16", None)
    quantized = logprobs(tp3_model_dir, ids, 3, 1, "int8", None)
    assert (quantized - dense).abs().mean().item() <= 2e-2
