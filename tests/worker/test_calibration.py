"""`shardline quantize`: a GPTQ-calibrated copy of a model directory loads as the dtype it was made
for with exactly the calibrated values, at every TP degree, and is refused by a plan of another
quantized dtype."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.modeling.config import ModelConfigError
from services.modeling.quant import dequantize
from services.worker.launch import run_replica_group
from services.worker.runtime import RankRuntime, RankSpec
from services.worker.scoring import score_rank
from tests.cli import run_cli
from tests.worker.test_parallel_parity import random_ids


def quantize_cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli("quantize", *args)


@pytest.fixture(scope="module")
def calibrated_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calibrated") / "fp8"
    run = quantize_cli("--model", str(tiny_model_dir), "--dtype", "fp8", "--out", str(out), "--chunks", "4",
                       "--chunk-tokens", "64", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["tensors"] == 4 * 7 + 1 and report["calibration_tokens"] == 256  # the tied table too
    return out


def test_the_copy_records_its_calibration(calibrated_dir: Path, tiny_model_dir: Path):
    config = json.loads((calibrated_dir / "config.json").read_text())
    record = config["shardline_calibration"]
    assert (record["scheme"], record["method"], record["lm_head"]) == ("fp8", "gptq", True)
    assert (calibrated_dir / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_loading_as_fp8_gives_exactly_the_calibrated_values(calibrated_dir: Path):
    saved = load_file(str(calibrated_dir / "model.safetensors"))
    rt = RankRuntime.start(RankSpec(str(calibrated_dir), dtype="fp8", activation_dtype="float32"), 0)
    o_proj = rt.model.model.layers["0"].self_attn.o_proj
    assert o_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize(o_proj.weight, o_proj.weight_scale), saved["model.layers.0.self_attn.o_proj.weight"])


@pytest.mark.slow  # real rank processes
def test_tp2_scores_the_copy_as_tp1(calibrated_dir: Path):
    ids = random_ids(40, 512, seed=3)

    def scores(tp: int) -> torch.Tensor:
        spec = RankSpec(str(calibrated_dir), tp_degree=tp, dtype="fp8", activation_dtype="float32")
        return torch.tensor(run_replica_group(tp, score_rank, spec, ids).logprobs)

    assert (scores(2) - scores(1)).abs().max().item() <= 1e-4


def test_another_quantized_dtype_is_refused_and_bad_arguments_exit_2(calibrated_dir: Path, tiny_model_dir: Path):
    with pytest.raises(ModelConfigError, match="calibrated for fp8"):
        RankSpec(str(calibrated_dir), dtype="int8")
    assert RankSpec(str(calibrated_dir), dtype="bfloat16").plan.dtype == "bfloat16"  # dense: just weights
    for args in (["--dtype", "bfloat16", "--out", str(calibrated_dir.parent / "x")],
                 ["--dtype", "fp8", "--out", str(tiny_model_dir)]):
        run = quantize_cli("--model", str(tiny_model_dir), *args)
        assert run.returncode == 2 and "shardline quantize:" in run.stderr and "Traceback" not in run.stderr
