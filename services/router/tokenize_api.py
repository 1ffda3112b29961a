"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, with the router's own tokenizer
and chat template (the ids a completion or chat request with the same body would send).

/tokenize takes ``prompt`` (``add_special_tokens``, default true) or ``messages``
(``add_generation_prompt``, default true; no special tokens added, the template spells them) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs``). /detokenize takes ``tokens`` and answers ``{"prompt"}``, special tokens
skipped as a completion's text is. No web framework here (``http_api.py``).
"""

from __future__ import annotations

from typing import Any

from services.router.catalog import ServedModel
from services.router.openai_format import BadRequest, chat_prompt_ids


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean, got {value!r}", name)
    return value


def tokenize(body: dict[str, Any], model: ServedModel) -> dict[str, Any]:
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise BadRequest("send either prompt (a string) or messages", "prompt")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise BadRequest(f"prompt must be a string, got {prompt!r}", "prompt")
        ids = model.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True)) if prompt else []
    else:
        ids = chat_prompt_ids(body["messages"], model,
                              add_generation_prompt=_flag(body, "add_generation_prompt", True),
                              add_special_tokens=_flag(body, "add_special_tokens", False))
    strs = [model.token_text(t) for t in ids] if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict[str, Any], model: ServedModel) -> dict[str, Any]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest(f"tokens must be a list of token ids, got {tokens!r}"[:200], "tokens")
    bad = [t for t in tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise BadRequest(f"tokens {bad[:5]} are outside the vocabulary [0, {model.vocab_size})", "tokens")
    return {"prompt": model.decode(tokens)}
