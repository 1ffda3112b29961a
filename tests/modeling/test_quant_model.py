"""Quantized plans end to end in the model library: which tensors are quantized, the bytes a rank
holds, exact sharding across TP degrees, and logits against the bfloat16 plan (tiny random Llama)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.modeling.attention import AttentionMetadata
from services.modeling.config import ModelConfig, ModelConfigError
from services.modeling.llama import LlamaForCausalLM
from services.modeling.parallel.coordinator import Coordinator
from services.modeling.parallel.groups import ParallelGroups
from services.modeling.parallel.plan import ParallelPlan
from services.modeling.quant import INT8, SCHEMES, quantize
from services.modeling.tiny import TinyModelSpec, write_tiny_model
from services.modeling.weights import CheckpointReader, load_weights

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

# SmolLM2-135M's shape (tied embeddings): the bytes a rank would hold, without its weights
SMOLLM2 = ModelConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, head_dim=64, tie_word_embeddings=True)
# divides TP 3: 6 heads, 3 KV heads, intermediate 384, vocab 384
TP3_SPEC = TinyModelSpec(layers=2, hidden=192, heads=6, kv_heads=3, intermediate=384, vocab=384, seed=3)


def rank_model(plan: ParallelPlan, tp_rank: int = 0, *, device: str | None = None) -> LlamaForCausalLM:
    groups = ParallelGroups(plan.tp_degree, plan.pp_degree, tp_rank, "none", None, None, None, None)
    return LlamaForCausalLM(plan, Coordinator(groups), device=device)


def loaded(model_dir: Path, plan: ParallelPlan, tp_rank: int = 0, *, device: str | None = None) -> LlamaForCausalLM:
    model = rank_model(plan, tp_rank, device=device)
    with CheckpointReader(model_dir) as reader:
        load_weights(model, reader, tie_word_embeddings=plan.config.tie_word_embeddings)
    return model


def held_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors once


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, spec in {"untied": TinyModelSpec(), "tied": TinyModelSpec(tie_embeddings=True),
                       "tp3": TP3_SPEC}.items():
        out[name] = tmp_path_factory.mktemp(name)
        write_tiny_model(spec, out[name])
    return out


def test_a_quantized_plan_computes_in_bfloat16_or_float32():
    plan = ParallelPlan(SMOLLM2, 1, 1, "int8")
    assert (plan.activation_dtype, plan.torch_dtype, plan.weight_quant) == ("bfloat16", torch.bfloat16, INT8)
    assert ParallelPlan(SMOLLM2, 1, 1, "fp8_e4m3", activation_dtype="fp32").torch_dtype == torch.float32
    assert ParallelPlan(SMOLLM2, 1, 1, "bf16").weight_quant is None
    with pytest.raises(ModelConfigError, match="dense plan computes in its own dtype"):
        ParallelPlan(SMOLLM2, 1, 1, "bfloat16", activation_dtype="float32")
    with pytest.raises(ModelConfigError, match="unknown dtype 'int4'"):
        ParallelPlan(SMOLLM2, 1, 1, "int4")


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_linear_weights_quantized_norms_and_untied_embedding_dense(dtype):
    scheme = SCHEMES[dtype]
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, head_dim=16)
    params = dict(rank_model(ParallelPlan(cfg, 1, 1, dtype), device="meta").named_parameters())
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert params[f"model.layers.0.{name}.weight"].dtype == scheme.weight_dtype
        assert params[f"model.layers.0.{name}.weight_scale"].dtype == torch.float32
    assert params["lm_head.weight"].dtype == scheme.weight_dtype  # quantize_lm_head defaults on
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert params["model.norm.weight"].dtype == torch.bfloat16
    assert params["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
    dense_head = dict(rank_model(ParallelPlan(cfg, 1, 1, dtype, quantize_lm_head=False),
                                 device="meta").named_parameters())
    assert dense_head["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_scale" not in dense_head


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_smollm2_weight_bytes_at_most_0_55_of_bfloat16(dtype):
    bf16 = held_bytes(rank_model(ParallelPlan(SMOLLM2, 1, 1, "bfloat16"), device="meta"))
    quantized = held_bytes(rank_model(ParallelPlan(SMOLLM2, 1, 1, dtype), device="meta"))
    assert quantized <= 0.55 * bf16, f"{quantized / bf16:.3f}"
    # the tied table kept dense is why quantize_lm_head is on by default
    dense_table = held_bytes(rank_model(ParallelPlan(SMOLLM2, 1, 1, dtype, quantize_lm_head=False), device="meta"))
    assert dense_table > 0.55 * bf16


@pytest.mark.parametrize("tie", ["untied", "tied"])
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_tiny_weight_bytes_loaded_at_most_0_55_of_bfloat16(tiny_dirs, tie, dtype):
    cfg = ModelConfig.from_dir(tiny_dirs[tie])
    bf16 = held_bytes(loaded(tiny_dirs[tie], ParallelPlan(cfg, 1, 1, "bfloat16")))
    assert held_bytes(loaded(tiny_dirs[tie], ParallelPlan(cfg, 1, 1, dtype))) <= 0.55 * bf16


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def tp3_shares(full: dict[str, tuple[torch.Tensor, torch.Tensor]], pre: str, rank: int, tp: int
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer ``pre``'s fused parameters on TP rank ``rank`` of ``tp`` (TP3_SPEC's shape), from
    every checkpoint linear's whole (codes, scales): a column-parallel part's rows with their
    scales, a row-parallel weight's columns with every row's scale."""
    def part(total: int) -> slice:
        return slice(rank * total // tp, (rank + 1) * total // tp)

    hidden, kv, inter = 192, 96, 384  # q rows and o columns; k and v rows; gate/up rows and down columns
    layout = {"self_attn.qkv_proj": [("self_attn.q_proj", part(hidden), None), ("self_attn.k_proj", part(kv), None),
                                     ("self_attn.v_proj", part(kv), None)],
              "mlp.gate_up_proj": [("mlp.gate_proj", part(inter), None), ("mlp.up_proj", part(inter), None)],
              "self_attn.o_proj": [("self_attn.o_proj", None, part(hidden))],
              "mlp.down_proj": [("mlp.down_proj", None, part(inter))]}
    shares = {}
    for param, parts in layout.items():
        qs, ss = [], []
        for ckpt, rows, cols in parts:
            q, s = full[f"{pre}.{ckpt}.weight"]
            qs.append(q[rows] if rows is not None else q[:, cols])
            ss.append(s[rows] if rows is not None else s)
        shares[param] = (torch.cat(qs), torch.cat(ss))
    return shares


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_tp3_ranks_hold_exactly_the_tp1_values(tiny_dirs, dtype):
    """Quantize the whole checkpoint tensor, then slice by the layer's rule == what each TP=3 rank
    quantized on load from its own slice; and the same bytes as the TP=1 model's."""
    scheme = SCHEMES[dtype]
    cfg = ModelConfig.from_dir(tiny_dirs["tp3"])
    tp1 = dict(loaded(tiny_dirs["tp3"], ParallelPlan(cfg, 1, 1, dtype, activation_dtype="float32")).named_parameters())
    full = {}
    with CheckpointReader(tiny_dirs["tp3"]) as reader:
        for name in reader.names():
            tensor = reader.get_slice(name)[:]
            if tensor.dim() == 2:  # norms stay dense
                full[name] = quantize(tensor, scheme)
    inter, vocab = 384 // 3, 384 // 3
    for rank in range(3):
        params = dict(loaded(tiny_dirs["tp3"], ParallelPlan(cfg, 3, 1, dtype, activation_dtype="float32"),
                             rank).named_parameters())
        for layer in range(cfg.num_hidden_layers):
            pre = f"model.layers.{layer}"
            for param, (want_q, want_s) in tp3_shares(full, pre, rank, 3).items():
                got_q, got_s = params[f"{pre}.{param}.weight"], params[f"{pre}.{param}.weight_scale"]
                assert torch.equal(raw_bytes(got_q), raw_bytes(want_q)), f"rank {rank} {pre}.{param}"
                assert torch.equal(got_s, want_s), f"rank {rank} {pre}.{param} scales"
            # the same bytes as the TP=1 model: row-parallel columns, column-parallel rows
            one = tp1[f"{pre}.mlp.down_proj.weight"][:, rank * inter:(rank + 1) * inter]
            assert torch.equal(raw_bytes(params[f"{pre}.mlp.down_proj.weight"]), raw_bytes(one))
            assert torch.equal(params[f"{pre}.mlp.down_proj.weight_scale"], tp1[f"{pre}.mlp.down_proj.weight_scale"])
        q, s = full["lm_head.weight"]
        assert torch.equal(raw_bytes(params["lm_head.weight"]), raw_bytes(q[rank * vocab:(rank + 1) * vocab]))
        assert torch.equal(params["lm_head.weight_scale"], s[rank * vocab:(rank + 1) * vocab])


def logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    n = ids.shape[0]
    return model.compute_logits(model(torch.arange(n), AttentionMetadata.prefill([n]), input_ids=ids))


# (max |Δ logit| / max |logit| against the same-activation dense plan, top-1 agreement at least)
BOUNDS = {"int8": (0.04, 0.95), "fp8": (0.12, 0.75)}


@pytest.mark.parametrize("tie", ["untied", "tied"])
@pytest.mark.parametrize("activation", ["bfloat16", "float32"])
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_tiny_quantized_logits_close_to_the_dense_plan(tiny_dirs, tie, activation, dtype):
    cfg = ModelConfig.from_dir(tiny_dirs[tie])
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    dense = logits(loaded(tiny_dirs[tie], ParallelPlan(cfg, 1, 1, activation)), ids)
    model = loaded(tiny_dirs[tie], ParallelPlan(cfg, 1, 1, dtype, activation_dtype=activation))
    got = logits(model, ids)
    rel, agree = BOUNDS[dtype]
    assert (got - dense).abs().max() <= rel * dense.abs().max()
    assert (got.argmax(-1) == dense.argmax(-1)).float().mean() >= agree
    # the first position sees only itself: a 1-token forward (the decode-sized, 1-row matmuls)
    # gives its logits again, to the activation dtype's rounding
    first = logits(model, ids[:1])[0]
    tol = 1e-4 if activation == "float32" else 0.02 * got[0].abs().max().item()
    torch.testing.assert_close(first, got[0], rtol=0, atol=tol)
