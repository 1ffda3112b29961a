"""Which device a rank runs on: ``--device auto|cpu|cuda``, and a clear refusal of a device this
machine does not have."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from services.modeling.parallel.groups import DeviceUnavailable, ParallelGroups, resolve_device
from tests.router.processes import REPO

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_auto_is_cuda_where_torch_sees_a_gpu_else_the_cpu():
    assert resolve_device("auto") == resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu" and ParallelGroups.single("cpu").device == torch.device("cpu")
    with pytest.raises(DeviceUnavailable, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        resolve_device("tpu")


@no_cuda
def test_cuda_without_a_gpu_is_refused_naming_the_torch_build(tiny_model_dir):
    refusal = re.escape(f"--device cuda, but torch {torch.__version__} sees no CUDA device")
    with pytest.raises(DeviceUnavailable, match=refusal):
        resolve_device("cuda")
    done = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--model", str(tiny_model_dir),
                           "--prompt-ids", "1,2,3", "--device", "cuda"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "shardline generate: --device cuda, but torch" in done.stderr, done.stderr
