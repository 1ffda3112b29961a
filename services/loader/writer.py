"""Cut an HF checkpoint into one safetensors file per rank, streaming, plus manifest.json.

For every rank the writer builds that rank's model on the ``meta`` device (names and shapes, no
memory), writes the file's header, then for each parameter allocates one real tensor, fills it
with the parameter's own ``weight_loader`` for every checkpoint tensor
:func:`~services.modeling.weights.checkpoint_assignments` gives it — the very code a worker
loading the HF directory runs, so a shard holds exactly the bytes that worker would hold — writes
and hashes it, and frees it. Peak memory is about one full source tensor (its mapped pages) plus
two rank-sized slices (one being sliced, the previous one being written), never a shard or the
model.

The source's non-weight files (config.json, the tokenizer, generation_config.json:
:data:`~services.loader.manifest.MODEL_FILE_NAMES`) are copied beside the shards and listed in
the manifest with their sha256, so a worker given only the checkpoint can also tokenize.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from services.common.dtypes import canonical_dtype
from services.loader.layout import RankLayout, model_fingerprint, rank_model, unique_parameters
from services.loader.manifest import (
    MANIFEST_NAME,
    MODEL_FILE_NAMES,
    Manifest,
    ModelFile,
    PlanInfo,
    ShardEntry,
    shard_file_name,
    shard_metadata,
)
from services.loader.object_store import ObjectStore, open_store
from services.loader.safetensors_format import encode_header, tensor_bytes
from services.modeling.config import ModelConfig
from services.modeling.parallel.plan import ParallelPlan
from services.modeling.weights import STACKED_PARAMS_MAPPING, CheckpointError, CheckpointReader, checkpoint_assignments

ProgressFn = Callable[[int], None]


@dataclass(frozen=True)
class ShardJob:
    """What to cut: the HF directory, the plan, and where the shards go."""

    model_dir: Path
    tp_degree: int
    pp_degree: int
    out: str
    dtype: str | None = None  # None: the checkpoint's own dtype (config.json torch_dtype); or int8/fp8
    model_name: str | None = None
    activation_dtype: str | None = None  # int8/fp8: the activations' (bfloat16 unless given)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir / 'config.json'} not found: expected a Hugging Face model directory")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if not str(self.out):
            raise ValueError("out must be a directory or s3://bucket/prefix, got an empty string")

    def plan(self) -> ParallelPlan:
        config = ModelConfig.from_dir(self.model_dir)
        return ParallelPlan(config, self.tp_degree, self.pp_degree, self.dtype or config.torch_dtype,
                            activation_dtype=self.activation_dtype)


def _expected_shard_ids(param_name: str) -> set[Any]:
    ids = {shard_id for fused, _, shard_id in STACKED_PARAMS_MAPPING if fused in param_name}
    return ids or {None}


def write_rank_shard(reader: CheckpointReader, plan: ParallelPlan, global_rank: int, dest: Path, *,
                     fingerprint: str, progress: ProgressFn | None = None) -> ShardEntry:
    """Write rank ``global_rank``'s shard to ``dest``; returns its manifest entry."""
    model = rank_model(plan, global_rank)
    all_params = dict(model.named_parameters(remove_duplicate=False))
    unique = unique_parameters(model)
    owner = {id(param): name for name, param in unique}
    # checkpoint tensors per stored tensor; a tied lm_head's assignments land on the embedding
    sources: dict[str, list[tuple[str, Any]]] = {name: [] for name, _ in unique}
    for ckpt_name, param_name, shard_id in checkpoint_assignments(
            all_params, reader.names(), tie_word_embeddings=plan.config.tie_word_embeddings):
        sources[owner[id(all_params[param_name])]].append((ckpt_name, shard_id))

    layout = RankLayout.of_model(model, plan, global_rank)
    metadata = shard_metadata(tp_degree=plan.tp_degree, pp_degree=plan.pp_degree, tp_rank=layout.tp_rank,
                              pp_stage=layout.pp_stage, layer_start=layout.layer_start, layer_end=layout.layer_end,
                              dtype=plan.dtype, model_fingerprint=fingerprint,
                              activation_dtype=plan.activation_dtype, quantization=plan.quantization)
    header, entries = encode_header([(n, i.dtype, i.shape) for n, i in layout.tensors.items()], metadata)
    digest = hashlib.sha256(header)
    partial = dest.with_name(dest.name + ".partial")
    # Writing and hashing tensor i (both release the GIL) overlap with slicing tensor i+1: at most
    # two rank-sized tensors are alive, and the file and the hash still see them in order.
    in_flight: list[Future[Any]] = []

    def drain() -> None:
        for future in in_flight:
            future.result()
        in_flight.clear()

    try:
        with open(partial, "wb") as out, ThreadPoolExecutor(max_workers=2, thread_name_prefix="shard-io") as io:
            out.write(header)
            for entry, (name, param) in zip(entries, unique, strict=True):
                # the parameter's own dtype: a quantized weight int8/e4m3, its scales float32
                tensor = torch.empty(entry.shape, dtype=param.dtype, device="cpu")
                filled = set()
                for ckpt_name, shard_id in sources[name]:
                    param.weight_loader(tensor, reader.get_slice(ckpt_name), shard_id)
                    filled.add(shard_id)
                # unmap the source file: the pages this tensor touched leave our RSS with it
                reader.close()
                if filled != _expected_shard_ids(name):
                    raise CheckpointError(
                        f"{reader.model_dir}: checkpoint lacks tensors for {name} "
                        f"(have {sorted(map(str, filled))}, need {sorted(map(str, _expected_shard_ids(name)))})")
                data = tensor_bytes(tensor)  # keeps the tensor alive until written and hashed
                if len(data) != entry.nbytes:  # invariant: the header was computed from the same shapes
                    raise AssertionError(f"{name}: {len(data)} bytes to write, header says {entry.nbytes}")
                drain()
                in_flight.extend((io.submit(out.write, data), io.submit(digest.update, data)))
                del tensor, data
                if progress is not None:
                    progress(entry.nbytes)
            drain()
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return ShardEntry(file=dest.name, tp_rank=layout.tp_rank, pp_stage=layout.pp_stage, bytes=dest.stat().st_size,
                      sha256=digest.hexdigest(), layer_start=layout.layer_start, layer_end=layout.layer_end,
                      tensors=layout.tensors)


def copy_model_files(model_dir: Path, store: ObjectStore) -> tuple[ModelFile, ...]:
    """Hash and store the source directory's non-weight files that exist (in
    :data:`MODEL_FILE_NAMES` order); returns their manifest entries."""
    copied: list[ModelFile] = []
    for name in MODEL_FILE_NAMES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 * 1024 * 1024):
                digest.update(chunk)
        store.put_file(name, path)
        copied.append(ModelFile(file=name, bytes=path.stat().st_size, sha256=digest.hexdigest()))
    return tuple(copied)


def _progress_bar(total: int, enabled: bool | None) -> Any:
    show = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="sharding", disable=not show,
                file=sys.stderr)


def write_shards(job: ShardJob, *, store: ObjectStore | None = None, endpoint_url: str | None = None,
                 progress: bool | None = None) -> Manifest:
    """Cut ``job.model_dir`` into ``job.out``; returns the manifest (written there last, so a
    manifest in the store always describes complete, uploaded shards).

    ``progress``: a bar on stderr; None shows it only when stderr is a terminal.
    """
    plan = job.plan()
    store = store if store is not None else open_store(job.out, endpoint_url=endpoint_url)
    fingerprint = model_fingerprint(job.model_dir)
    layouts = [RankLayout.for_rank(plan, rank) for rank in range(plan.world_size)]
    bar = _progress_bar(sum(layout.nbytes for layout in layouts), progress)
    local_root = store.local_path(MANIFEST_NAME)
    store.delete(MANIFEST_NAME)  # an old manifest must not outlive the shards it described
    entries: list[ShardEntry] = []
    try:
        with CheckpointReader(job.model_dir) as reader, tempfile.TemporaryDirectory(prefix="shardline-shard-") as tmp:
            staging = local_root.parent if local_root is not None else Path(tmp)
            staging.mkdir(parents=True, exist_ok=True)
            for rank, layout in enumerate(layouts):
                name = shard_file_name(layout.tp_rank, layout.pp_stage)
                path = staging / name
                entries.append(write_rank_shard(reader, plan, rank, path, fingerprint=fingerprint, progress=bar.update))
                if local_root is None:  # remote store: upload, then free the disk for the next shard
                    store.put_file(name, path)
                    path.unlink()
    finally:
        bar.close()
    model_files = copy_model_files(job.model_dir, store)
    manifest = Manifest(
        model_name=job.model_name or plan.config.name,
        model_config=plan.config.raw,
        model_fingerprint=fingerprint,
        plan=PlanInfo(plan.tp_degree, plan.pp_degree, plan.dtype,
                      tuple((r.start, r.stop) for r in plan.layer_ranges),
                      activation_dtype=plan.activation_dtype if plan.quantization else None,
                      quantization=plan.quantization),
        shards=tuple(entries),
        total_bytes=sum(e.bytes for e in entries),
        model_files=model_files,
    )
    store.put_bytes(MANIFEST_NAME, manifest.to_json().encode())
    return manifest
