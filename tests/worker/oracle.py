"""The unsharded reference: transformers.LlamaForCausalLM on the same weights (tests only)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def _load(model_dir: str, dtype: str):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.eval()


def reference_logprobs(model_dir: str, ids: list[int], dtype: str = "float32") -> torch.Tensor:
    """log p(ids[i+1] | ids[..i]) from transformers, as float32."""
    model = _load(str(model_dir), dtype)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def reference_greedy(model_dir: str, ids: list[int], max_new_tokens: int, dtype: str = "float32", *,
                     repetition_penalty: float = 1.0) -> list[int]:
    """transformers' greedy tokens (with its repetition_penalty over prompt and output, the rule
    vLLM's follows); computed once per process for the same arguments (the layouts of one test
    all compare against the same reference)."""
    return list(_greedy(str(model_dir), tuple(ids), max_new_tokens, dtype, repetition_penalty))


@functools.lru_cache(maxsize=64)
def _greedy(model_dir: str, ids: tuple[int, ...], max_new_tokens: int, dtype: str,
            repetition_penalty: float) -> tuple[int, ...]:
    model = _load(model_dir, dtype)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             repetition_penalty=repetition_penalty)
    return tuple(out[0, len(ids):].tolist())
