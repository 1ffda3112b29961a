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
from services.router.protocol import DetokenizeRequest, TokenizeRequest, validate


def _flag(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def tokenize(body: dict[str, Any], model: ServedModel) -> dict[str, Any]:
    req = validate(TokenizeRequest, body)
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("send either prompt (a string) or messages", "prompt")
    if req.prompt is not None:
        ids = model.encode(req.prompt, add_special_tokens=_flag(req.add_special_tokens, True)) if req.prompt else []
    else:
        ids = chat_prompt_ids(body["messages"], model,
                              add_generation_prompt=_flag(req.add_generation_prompt, True),
                              add_special_tokens=_flag(req.add_special_tokens, False))
    strs = [model.token_text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict[str, Any], model: ServedModel) -> dict[str, Any]:
    tokens = validate(DetokenizeRequest, body).tokens
    bad = [t for t in tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise BadRequest(f"tokens {bad[:5]} are outside the vocabulary [0, {model.vocab_size})", "tokens")
    return {"prompt": model.decode(tokens)}
