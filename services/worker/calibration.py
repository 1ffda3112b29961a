"""Calibrated quantization of an HF model directory (``shardline quantize``): the model runs
once, dense and float32 on one rank, over calibration text; each linear layer's input Hessian is
accumulated; then every decoder linear weight (and the lm_head, or the tied embedding table it
shares, unless ``lm_head`` stays dense) is rounded onto the scheme's grid with GPTQ
(:mod:`services.modeling.gptq`) and written back, as ``scale · code`` in float32, to a copy of
the directory.

The copy is an ordinary model directory: loading it as ``--dtype int8|fp8`` (on load, or through
``shardline shard``) quantizes with the usual per-output-channel round-to-nearest and recovers
exactly the calibrated codes, at every TP degree. Its ``config.json`` records how it was made
(``shardline_calibration``), so that a plan of another dtype can be told it is not what the
copy was calibrated for.

The calibration text is not the golden set's (see :func:`calibration_text`): the quality gate
scores the result on text the calibration never saw.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.modeling.compressed_tensors import compressed_format
from services.modeling.config import CALIBRATION_KEY
from services.modeling.gptq import DEFAULT_DAMP, HessianAccumulator, gptq_round
from services.modeling.parallel.layers import LinearBase, VocabParallelEmbedding
from services.modeling.quant import QuantScheme
from services.modeling.weights import IGNORED_SUFFIXES, CheckpointReader, map_checkpoint_name
from services.quality.golden_set import calibration_text, fingerprint
from services.worker.engine.bootstrap import load_tokenizer
from services.worker.runtime import RankRuntime, RankSpec
from services.worker.scoring import score_tokens

log = logging.getLogger(__name__)
DEFAULT_CALIBRATION_CHUNKS = 32
DEFAULT_CALIBRATION_TOKENS = 512


@dataclass(frozen=True)
class CalibrationReport:
    out_dir: Path
    tensors: int  # checkpoint tensors rounded with GPTQ
    calibration_tokens: int
    seconds: float

    def to_dict(self) -> dict:
        return {"out_dir": str(self.out_dir), "tensors": self.tensors,
                "calibration_tokens": self.calibration_tokens, "seconds": round(self.seconds, 1)}


def calibration_chunks(model_dir: str, chunks: int, chunk_tokens: int) -> list[list[int]]:
    """``chunks`` windows of ``chunk_tokens`` ids spread evenly over the calibration text."""
    ids = load_tokenizer(model_dir).encode(calibration_text(), add_special_tokens=False).ids
    if len(ids) < chunks * chunk_tokens:
        raise ValueError(f"the calibration text has {len(ids)} tokens; {chunks} x {chunk_tokens} need more")
    stride = len(ids) // chunks
    return [ids[i * stride:i * stride + chunk_tokens] for i in range(chunks)]


def collect_hessians(model_dir: str, chunks: list[list[int]]) -> dict[str, torch.Tensor]:
    """Input Hessian of every linear layer (module name -> [K, K]) of the dense float32 model
    run on ``chunks``, in this process (one rank)."""
    rt = RankRuntime.start(RankSpec(model_dir, dtype="float32", replica_group_id="calibration"), 0)
    accumulators: dict[str, HessianAccumulator] = {}
    watched = []
    # the decoder layers call their linears' ``forward`` directly (no hooks run), so each one's
    # ``forward`` is wrapped for the calibration run and restored after
    for name, module in rt.model.named_modules():
        if not isinstance(module, LinearBase) or type(module) is VocabParallelEmbedding:
            continue
        acc = accumulators[name] = HessianAccumulator(module.weight.shape[1])

        def watching(x: torch.Tensor, *rest, _forward=module.forward, _acc=acc):
            _acc.add(x)
            return _forward(x, *rest)
        module.forward = watching
        watched.append(module)
    try:
        with torch.no_grad():
            for chunk in chunks:
                score_tokens(rt, chunk)
    finally:
        for module in watched:
            del module.forward
    return {name: acc.hessian() for name, acc in accumulators.items()}


def _module_of(checkpoint_name: str, *, tied: bool, quantize_lm_head: bool) -> str | None:
    """The linear module whose inputs calibrate this checkpoint tensor, or None (left as is)."""
    if not checkpoint_name.endswith(".weight") or checkpoint_name.endswith(IGNORED_SUFFIXES):
        return None
    if checkpoint_name in ("lm_head.weight", "model.embed_tokens.weight"):
        table_is_head = checkpoint_name == "lm_head.weight" or tied
        return "lm_head" if quantize_lm_head and table_is_head else None
    param_name, _ = map_checkpoint_name(checkpoint_name)
    module = param_name.removesuffix(".weight")
    return module if ".layers." in module and module.endswith("_proj") else None


def quantize_model_dir(model_dir: Path, out_dir: Path, scheme: QuantScheme, *, quantize_lm_head: bool = True,
                       chunks: int = DEFAULT_CALIBRATION_CHUNKS, chunk_tokens: int = DEFAULT_CALIBRATION_TOKENS,
                       damp: float = DEFAULT_DAMP) -> CalibrationReport:
    """Writes the calibrated copy of ``model_dir`` to ``out_dir`` (see the module docstring)."""
    start = time.perf_counter()
    config = json.loads((model_dir / "config.json").read_text())
    compressed = compressed_format(config)
    if compressed is not None:
        raise ValueError(f"{model_dir} is already quantized ({compressed.describe()}): calibrate the original "
                         f"weights, or serve these as {compressed.scheme.name}")
    tied = bool(config.get("tie_word_embeddings", False))
    token_chunks = calibration_chunks(str(model_dir), chunks, chunk_tokens)
    hessians = collect_hessians(str(model_dir), token_chunks)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    rounded = 0
    with CheckpointReader(model_dir) as reader:
        for name in reader.names():
            tensor = reader.get_slice(name)[:]
            module = _module_of(name, tied=tied, quantize_lm_head=quantize_lm_head)
            if module is not None and module in hessians and tensor.dim() == 2:
                tensor = gptq_round(tensor.float(), hessians[module], scheme, damp=damp)
                rounded += 1
            tensors[name] = tensor.contiguous()
    for path in model_dir.iterdir():  # config, tokenizer, generation config ...
        if path.is_file() and not path.name.startswith("model.safetensors"):
            shutil.copy2(path, out_dir / path.name)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config[CALIBRATION_KEY] = {"scheme": scheme.name, "method": "gptq", "granularity": scheme.granularity,
                               "lm_head": quantize_lm_head, "damp": damp, "chunks": chunks,
                               "chunk_tokens": chunk_tokens, "text_fingerprint": fingerprint(calibration_text()),
                               "source": str(model_dir)}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return CalibrationReport(out_dir, rounded, chunks * chunk_tokens, time.perf_counter() - start)
