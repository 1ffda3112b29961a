"""A request made ready for the router's request path (``service.py``): the prompt checks that need no
tokenizing, and the validated request with its ids."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.common.sampling import SamplingParams
from services.router.admission import context_error
from services.router.catalog import ServedModel
from services.router.types import GenerationRequest


@dataclass(frozen=True)
class Prepared:
    """A validated request: its model, prompt ids and sampling."""

    model: ServedModel
    prompt_ids: list[int]
    sampling: SamplingParams
    request_id: str
    token_texts: bool = False
    trace_context: tuple[tuple[str, str], ...] = ()


def check_prompt(model: ServedModel, request: GenerationRequest) -> str | None:
    """The checks that need no tokenizing; the text to tokenize (None: token ids given)."""
    if request.prompt_ids is not None:
        ids = request.prompt_ids
        if not ids:
            raise InvalidArgument("prompt must not be empty: token_ids has no ids")
        if len(ids) > model.max_model_len:  # before looking at each id: there may be millions
            raise context_error(model.max_model_len, len(ids), request.sampling.max_tokens)
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if model.vocab_size and bad:
            raise InvalidArgument(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {model.vocab_size})")
        return None
    if request.prompt_text:
        return request.prompt_text  # ServedModel.encode bounds its length before tokenizing
    raise InvalidArgument("prompt must not be empty: set text or token_ids")


def prepared_request(model: ServedModel, request: GenerationRequest, ids: list[int] | None,
                     token_texts: bool) -> Prepared:
    """The validated request, with its prompt ids (``ids``: the text's; None: the request's own) and an id."""
    if ids is None:
        ids = list(request.prompt_ids or ())
    elif not ids:
        raise InvalidArgument("prompt must not be empty: the text has no tokens")
    request_id = request.request_id or f"rtr-{uuid.uuid4().hex[:16]}"
    return Prepared(model, ids, request.sampling, request_id, token_texts or request.sampling.logprobs > 0,
                    request.trace_context)
