"""A Llama-family decoder built from tensor-parallel layers, one pipeline stage at a time.

RMSNorm, rotary embeddings (with Llama-3 scaling), grouped-query attention and a SwiGLU MLP. The
element-wise pieces run through ``services.modeling.kernels`` (fused C++ kernels on CPU, the PyTorch
reference elsewhere); the matmuls and attention are PyTorch's, except a quantized plan's linear
layers, which multiply through ``services.modeling.quant``. Parameter names match the Hugging
Face checkpoint after fusing q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; layers keep
their *global* index (``model.layers.17``) so a stage owning layers 15..29 finds its weights by name.

The model never sends or receives between stages: :meth:`LlamaForCausalLM.forward` takes either
token ids (stage 0) or the previous stage's hidden states, and the runner moves tensors between
stages through the coordinator.
"""

from __future__ import annotations

import torch
from torch import nn

from services.modeling.attention import AttentionMetadata, attention_no_cache
from services.modeling.config import ModelConfig
from services.modeling.kernels import LayerOps, TorchOps, ops_for, stage_weights
from services.modeling.parallel.coordinator import Coordinator
from services.modeling.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    replicated_loader,
)
from services.modeling.parallel.plan import ParallelPlan
from services.modeling.quant import QuantScheme
from services.modeling.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    """``y = w · x / sqrt(mean(x²) + ε)``, computed in float32 and cast back (as the reference)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = replicated_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchOps.rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, coordinator: Coordinator, *, dtype: torch.dtype, device=None,
                 quant: QuantScheme | None = None, invariant_chunks: int = 0) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, coordinator, dtype=dtype, device=device,
                                          quant=quant)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        coordinator, dtype=dtype, device=device, quant=quant,
                                        invariant_chunks=invariant_chunks)
        self.heads = self.qkv_proj.heads_local
        self.kv_heads = self.qkv_proj.kv_heads_local
        self.scale = cfg.head_dim ** -0.5
        # set by the engine: (k_cache, v_cache), each [blocks, block_size, kv_heads, head_dim]
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               ops: LayerOps) -> torch.Tensor:
        """Rotated q [tokens, heads, d], k and v [tokens, kv_heads, d] → [tokens, heads · d]:
        store k/v in the paged cache, attend over each sequence's context."""
        n = q.shape[0]
        if self.kv_cache is None or meta.slot_mapping is None:
            out = attention_no_cache(q, k, v, meta, self.scale)
        else:
            k_cache, v_cache = self.kv_cache
            ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            if meta.is_decode:
                out = ops.decode_attention(q, k_cache, v_cache, meta, self.scale)
            else:
                out = ops.prefill_attention(q, k_cache, v_cache, meta, self.scale)
        return out.reshape(n, self.heads * self.head_dim)


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))`` — gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, coordinator: Coordinator, *, dtype: torch.dtype, device=None,
                 quant: QuantScheme | None = None, invariant_chunks: int = 0) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       coordinator, dtype=dtype, device=device, quant=quant)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, coordinator,
                                           dtype=dtype, device=device, quant=quant,
                                           invariant_chunks=invariant_chunks)

class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, coordinator: Coordinator, *, dtype: torch.dtype, device=None,
                 quant: QuantScheme | None = None, invariant_chunks: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(cfg, coordinator, dtype=dtype, device=device, quant=quant,
                                        invariant_chunks=invariant_chunks)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = LlamaMLP(cfg, coordinator, dtype=dtype, device=device, quant=quant,
                            invariant_chunks=invariant_chunks)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual convention: takes the previous layer's output ``h`` and the residual
        stream before it (None at a stage's first layer), returns the same pair for the next
        layer; each residual add is fused with the RMSNorm that follows it, in place (``h`` and
        ``residual`` are this step's own activations)."""
        attn, eps = self.self_attn, self.input_layernorm.eps
        if residual is None:
            residual, x = h, ops.rms_norm(h, self.input_layernorm.weight, eps)
        else:
            ops.add_rms_norm_(h, residual, self.input_layernorm.weight, eps)  # residual += h; h = norm
            x = h
        heads, kv_heads = attn.heads, attn.kv_heads
        qkv = attn.qkv_proj.forward(x).view(x.shape[0], heads + 2 * kv_heads, attn.head_dim)
        ops.rotary_(qkv, *rope, heads + kv_heads)  # q and k, in place
        q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        # o_proj and down_proj end in the coordinator's all-reduce when TP > 1; ``.forward`` skips
        # nn.Module.__call__'s hook handling (there are no hooks), a few microseconds per call
        x = attn.o_proj.forward(attn.attend(q, k, v, meta, ops))
        ops.add_rms_norm_(x, residual, self.post_attention_layernorm.weight, eps)
        mlp = self.mlp
        return mlp.down_proj.forward(ops.silu_and_mul(mlp.gate_up_proj.forward(x))), residual


class LlamaModel(nn.Module):
    def __init__(self, plan: ParallelPlan, coordinator: Coordinator, *, device=None) -> None:
        super().__init__()
        cfg, groups = plan.config, coordinator.groups
        dtype = plan.torch_dtype
        self.is_first = groups.is_first_stage
        self.is_last = groups.is_last_stage
        self.layer_range = plan.stage_layers(groups.pp_stage)
        # the embedding is quantized only as the table a quantized tied lm_head shares (on every
        # stage that holds it, so a PP>1 plan keeps the same values as PP=1)
        embed_quant = plan.lm_head_quant if cfg.tie_word_embeddings else None
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, coordinator, dtype=dtype,
                                                    device=device, quant=embed_quant) if self.is_first else None)
        self.layers = nn.ModuleDict({
            str(i): LlamaDecoderLayer(cfg, coordinator, dtype=dtype, device=device, quant=plan.weight_quant,
                                      invariant_chunks=plan.invariant_chunks)
            for i in self.layer_range
        })
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device) if self.is_last else None
        self.ops: LayerOps = ops_for(device)
        # whole layers on this rank (no all-reduce inside one): the C++ kernels may run them in one
        # call (False: the Python loop, layer by layer; the tests compare the two). In the
        # layout-invariant numerics the call sums the row-parallel layers' fixed k-chunks
        self.fused_layers = groups.tp_degree == 1
        self.invariant_chunks = plan.invariant_chunks
        self._attns = [layer.self_attn for layer in self.layers.values()]
        self._stage_args: tuple | None = None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      scaling=cfg.rope_scaling, device=device)

    def _stage(self) -> tuple | None:
        """``decoder_layers``' per-stage arguments while every layer has its KV cache (None
        otherwise). Taken again only when the caches change (allocated or freed: every layer's at
        once); the weights are loaded in place, so they stay the model's own."""
        caches = self._attns[0].kv_cache
        if self._stage_args is not None and self._stage_args[1][0] is not (caches or (None,))[0]:
            self._stage_args = None
        if self._stage_args is None and all(a.kv_cache is not None for a in self._attns):
            layers = list(self.layers.values())
            weights = stage_weights(
                (layer.input_layernorm.weight, layer.self_attn.qkv_proj.kernel_weight(),
                 layer.self_attn.qkv_proj.weight_scale,
                 layer.self_attn.o_proj.stage_weight(), layer.self_attn.o_proj.weight_scale,
                 layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj.kernel_weight(),
                 layer.mlp.gate_up_proj.weight_scale, layer.mlp.down_proj.stage_weight(),
                 layer.mlp.down_proj.weight_scale)
                for layer in layers)
            a = self._attns[0]
            self._stage_args = (weights, [a.kv_cache[0] for a in self._attns], [a.kv_cache[1] for a in self._attns],
                                layers[0].input_layernorm.eps, a.scale, a.heads, a.kv_heads, a.head_dim)
        return self._stage_args

    def forward(self, positions: torch.Tensor, meta: AttentionMetadata, *,
                input_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            assert input_ids is not None, "stage 0 takes token ids"
            h = self.embed_tokens(input_ids)
        else:
            assert hidden_states is not None, "a later stage takes the previous stage's hidden states"
            h = hidden_states
        rope = self.rotary.tables(positions, h.dtype)
        residual = None
        ops = self.ops
        stage = (self._stage() if self.fused_layers and self.layers and meta.slot_mapping is not None
                 and hasattr(ops, "decoder_layers") else None)
        if stage is not None:
            # the same kernels as the loop below, called from C++: no interpreter between them
            weights, k_caches, v_caches, eps, scale, heads, kv_heads, head_dim = stage
            h, residual = ops.decoder_layers(h.contiguous(), None, weights, k_caches, v_caches, rope, meta, eps,
                                             scale, heads, kv_heads, head_dim, self.invariant_chunks)
        else:
            for layer in self.layers.values():
                h, residual = layer.forward(h, residual, rope, meta, ops)  # no hooks: skip __call__
        if residual is None:  # a stage without layers
            return self.norm(h) if self.is_last else h
        if self.is_last:
            self.ops.add_rms_norm_(h, residual, self.norm.weight, self.norm.eps)
            return h
        return residual + h


class LlamaForCausalLM(nn.Module):
    """One pipeline stage of a TP-sharded Llama. Stage 0 owns the embedding, the last stage the
    final norm and lm_head (tied embeddings: the last stage loads its own copy of the table)."""

    def __init__(self, plan: ParallelPlan, coordinator: Coordinator, *, device=None) -> None:
        super().__init__()
        self.plan = plan
        self.config = plan.config
        self.model = LlamaModel(plan, coordinator, device=device)
        self.lm_head = None
        if self.model.is_last:
            cfg = plan.config
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, coordinator,
                                          dtype=plan.torch_dtype, device=device, quant=plan.lm_head_quant)
            if cfg.tie_word_embeddings and self.model.embed_tokens is not None:
                # one table (and, quantized, one set of scales), loaded once
                self.lm_head.weight = self.model.embed_tokens.weight
                if self.lm_head.quant is not None:
                    self.lm_head.weight_scale = self.model.embed_tokens.weight_scale

    @property
    def is_first_stage(self) -> bool:
        return self.model.is_first

    @property
    def is_last_stage(self) -> bool:
        return self.model.is_last

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers.values()]

    @torch.inference_mode()
    def forward(self, positions: torch.Tensor, meta: AttentionMetadata, *,
                input_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after this stage (final-normed on the last stage): [tokens, hidden]."""
        return self.model(positions, meta, input_ids=input_ids, hidden_states=hidden_states)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """Full-vocabulary logits (all-gathered across TP) for the given rows, in float32 or, with
        ``float32=False``, in the model's dtype (the sampler reads either)."""
        assert self.lm_head is not None, "only the last stage computes logits"
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits
