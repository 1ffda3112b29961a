"""A worker rank loading its pre-sharded checkpoint: plan check, stage, verify, then copy.

Order matters: the manifest is checked against the plan before anything is downloaded, the shard
is verified (bytes, header, tensors vs the rank's model) before any weight touches the model, and
only then are its tensors copied into the parameters — same names, same dtype, so bitwise.

The entry point for :class:`~services.worker.runtime.RankRuntime` is
:func:`load_checkpoint_weights`; :func:`plan_for_checkpoint` builds the plan from the manifest
when the worker has no HF directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from services.common.dtypes import canonical_dtype
from services.common.numerics import DEFAULT_NUMERICS
from services.loader.errors import ObjectNotFound, ShardLayoutError
from services.loader.layout import RankLayout, unique_parameters
from services.loader.manifest import Manifest
from services.loader.staging import DEFAULT_ATTEMPTS, StageResult, default_cache_dir, stage_entry
from services.loader.verify import check_entry_layout, check_plan, read_manifest, verify_rank_shard
from services.modeling.config import ModelConfig
from services.modeling.llama import LlamaForCausalLM
from services.modeling.parallel.plan import ParallelPlan


def load_rank_shard(model: LlamaForCausalLM, manifest: Manifest, shard_path: str | Path, plan: ParallelPlan,
                    rank: int, *, expected_fingerprint: str | None = None, staged: StageResult | None = None) -> int:
    """Verify rank ``rank``'s shard at ``shard_path`` against ``manifest``, ``plan`` and ``model``,
    then copy its tensors into ``model``; returns the bytes loaded.

    ``staged``: the result of staging this very file just now, whose bytes and header were
    verified on the way in; they are then not hashed a second time (plan and layout still are).
    Raises :class:`ShardLayoutError` (before the model is touched) on any mismatch.
    """
    layout = RankLayout.of_model(model, plan, rank)
    if staged is not None and Path(staged.local_path) == Path(shard_path):
        check_plan(manifest, plan, expected_fingerprint=expected_fingerprint, source=str(shard_path))
        check_entry_layout(manifest.shard(layout.tp_rank, layout.pp_stage), layout, source=str(shard_path))
    else:
        verify_rank_shard(manifest, shard_path, plan, rank, layout=layout, expected_fingerprint=expected_fingerprint)
    params = dict(unique_parameters(model))
    loaded = 0
    with safe_open(str(shard_path), framework="pt", device="cpu") as shard, torch.no_grad():
        names = set(shard.keys())
        if names != set(params):  # verified above; a file swapped since is refused, not half-loaded
            raise ShardLayoutError(f"{shard_path}: changed after verification (tensor names differ)")
        for name, param in params.items():
            tensor = shard.get_tensor(name)
            if tensor.shape != param.shape or tensor.dtype != param.dtype:
                raise ShardLayoutError(f"{shard_path}: {name} is {list(tensor.shape)} {tensor.dtype}, "
                                       f"model has {list(param.shape)} {param.dtype}")
            param.copy_(tensor)
            loaded += tensor.numel() * tensor.element_size()
    return loaded


def plan_for_checkpoint(checkpoint_uri: str | Path, *, tp_degree: int, pp_degree: int, dtype: str | None = None,
                        activation_dtype: str | None = None, endpoint_url: str | None = None,
                        numerics: str = DEFAULT_NUMERICS) -> ParallelPlan:
    """The plan a worker runs when the checkpoint is its only source of the model's shape.

    ``dtype`` and ``activation_dtype`` default to the checkpoint's, and so does whether the
    lm_head is quantized; a dtype other than the checkpoint's is refused later, by the checks.
    """
    manifest, _ = read_manifest(checkpoint_uri, endpoint_url=endpoint_url)
    config = ModelConfig.from_dict(manifest.model_config, name=manifest.model_name)
    got = manifest.plan
    dtype = dtype or got.dtype
    same_scheme = got.quantization is not None and canonical_dtype(dtype) == got.dtype
    return ParallelPlan(config, tp_degree, pp_degree, dtype,
                        activation_dtype=activation_dtype or (got.activation_dtype if same_scheme else None),
                        quantize_lm_head=bool(got.quantization["lm_head"]) if same_scheme else True,
                        numerics=numerics)


def load_checkpoint_weights(model: LlamaForCausalLM, plan: ParallelPlan, rank: int, checkpoint_uri: str | Path, *,
                            cache_dir: str | Path | None = None, expected_fingerprint: str | None = None,
                            endpoint_url: str | None = None, attempts: int = DEFAULT_ATTEMPTS) -> int:
    """Load rank ``rank``'s weights from the pre-sharded checkpoint at ``checkpoint_uri``.

    A checkpoint in a local directory is verified and read in place unless ``cache_dir`` is
    given; one in S3 is staged into ``cache_dir`` (default ``$SHARDLINE_SHARD_CACHE`` or
    ``~/.cache/shardline/shards``). ``expected_fingerprint`` (from
    :func:`services.loader.layout.model_fingerprint` of the HF directory the worker was given)
    also refuses a checkpoint of a same-shaped but different model. Returns the bytes loaded.
    """
    manifest, store = read_manifest(checkpoint_uri, endpoint_url=endpoint_url)
    check_plan(manifest, plan, expected_fingerprint=expected_fingerprint, source=str(checkpoint_uri))
    pp_stage, tp_rank = plan.coords(rank)
    entry = manifest.shard(tp_rank, pp_stage)
    in_place = store.local_path(entry.file) if cache_dir is None else None
    if in_place is not None:
        if not in_place.is_file():
            raise ObjectNotFound(f"{in_place}: shard {entry.file} listed in {checkpoint_uri} is missing")
        return load_rank_shard(model, manifest, in_place, plan, rank, expected_fingerprint=expected_fingerprint)
    staged = stage_entry(manifest, store, entry, cache_dir if cache_dir is not None else default_cache_dir(),
                         attempts=attempts)
    return load_rank_shard(model, manifest, staged.local_path, plan, rank, expected_fingerprint=expected_fingerprint,
                           staged=staged)
