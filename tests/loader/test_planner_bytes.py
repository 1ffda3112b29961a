"""The planner's weight bytes per GPU are the bytes a rank holds: for dense and quantized dtypes,
tied and untied tables, under TP and PP, the cost model's per-stage bytes equal what the shard
writer lays out for each rank of that stage (one definition: the rank's model on ``meta``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from services.loader.layout import RankLayout
from services.loader.safetensors_format import ITEMSIZE
from services.modeling.config import ModelConfig
from services.modeling.parallel.plan import ParallelPlan
from services.planner.cost_model import Candidate, CostModel, Workload
from services.planner.specs import ModelSpec
from services.planner.topology import PRESETS as TOPOLOGIES
from tests.loader.conftest import ShardedFn, load_manifest

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "fp8"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("which", ["tiny_dir", "tied_dir"])
def test_cost_model_bytes_are_the_rank_layout_bytes(which: str, tp: int, pp: int, dtype: str,
                                                     request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(which)
    spec = ModelSpec.from_hf_config(json.loads((model_dir / "config.json").read_text()), name=which)
    estimate = CostModel(spec, TOPOLOGIES["a100-80g-8x"], Workload()).estimate(Candidate(tp, pp, dtype))
    plan = ParallelPlan(ModelConfig.from_dir(model_dir), tp, pp, dtype)
    for stage in estimate.stages:
        held = {RankLayout.for_rank(plan, stage.stage * tp + r).nbytes for r in range(tp)}
        assert held == {stage.weight_bytes}, (stage.stage, held, stage.weight_bytes)


def test_a_written_int8_checkpoint_matches_the_plan_within_one_percent(tiny_dir: Path, sharded: ShardedFn) -> None:
    manifest = load_manifest(sharded(tiny_dir, 2, 1, "int8"))
    spec = ModelSpec.from_hf_config(json.loads((tiny_dir / "config.json").read_text()), name="tiny")
    planned = CostModel(spec, TOPOLOGIES["a100-80g-8x"], Workload()).estimate(Candidate(2, 1, "int8"))
    written = max(sum(math.prod(t.shape) * ITEMSIZE[t.dtype] for t in entry.tensors.values())
                  for entry in manifest.shards)
    assert abs(written - planned.weight_bytes_per_gpu) <= 0.01 * planned.weight_bytes_per_gpu
