"""`python -m bench.gpu.check --device cpu --quick`: the device check's own code, run on the CPU
so that it never rots between the rare sessions that are lent a GPU, with only the packages the
GPU machine's image has. Its figures say nothing about a GPU; its structure and its checks do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.common.config import child_environ
from tests.router.processes import REPO

pytestmark = pytest.mark.timeout(300)

CHECKS = {("float32", name) for name in ("prompt_logprobs", "decode_logprobs", "greedy_tokens", "graphs_vs_eager",
                                         "batch_invariance")}
CHECKS |= {("bfloat16", name) for name in ("prompt_logprobs", "decode_logprobs", "greedy_tokens", "graphs_vs_eager")}
CHECKS |= {("int8", "logits_vs_bfloat16"), ("fp8", "logits_vs_bfloat16")}


def test_the_device_check_runs_on_the_cpu_with_the_device_images_packages(tmp_path):
    report = tmp_path / "imports.json"
    argv = [sys.executable, "-m", "tests.bench.device_image", str(report), "bench.gpu.check", "--device", "cpu",
            "--quick", "--out", str(tmp_path)]
    run = subprocess.run(argv, cwd=REPO, env=child_environ(), capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(report.read_text()) == {}  # nothing beyond torch, transformers, safetensors, tokenizers

    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["device"] == "cpu" and result["quick"] and result["passed"]
    assert {(c["dtype"], c["name"]) for c in result["correctness"]} == CHECKS
    # bfloat16 greedy tokens are reported, not required: a rounding may flip a near-tie
    assert all(c["passed"] for c in result["correctness"] if c["required"]), result["correctness"]
    assert {(c["dtype"], c["name"]) for c in result["correctness"] if not c["required"]} == {
        ("bfloat16", "greedy_tokens")}
    assert all(c["model"] == "tiny" for c in result["correctness"])
    rows = {(r["shape"], r["dtype"], r["batch"]): r for r in result["decode"]}
    assert set(rows) == {("tiny", dtype, batch) for dtype in ("bfloat16", "fp8") for batch in (1, 4)}
    for r in rows.values():
        assert r["tpot_ms"] > 0 and r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["tpot_ms"])
        assert r["step_over_roofline"] == pytest.approx(r["tpot_ms"] / r["roofline_ms"])
        assert not r["graphs"]  # no CUDA here: the padded static steps ran eagerly
    # fp8 reads half the bytes of bfloat16 per step (its linear weights are one byte wide)
    assert rows[("tiny", "fp8", 1)]["weight_gb"] < 0.6 * rows[("tiny", "bfloat16", 1)]["weight_gb"]
    assert result["bandwidth_gb_s"] > 0 and result["target"] is None  # the 70B shape runs on a GPU only
    markdown = (tmp_path / "gpu.md").read_text()
    assert "Correctness: **passed**" in markdown and "| tiny | fp8 | 4 |" in markdown
