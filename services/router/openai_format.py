"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions.

Pure functions from JSON bodies to the router's :class:`GenerationRequest` and from stream
events back to OpenAI's objects (``text_completion``, ``chat.completion``, their streaming
chunks, ``usage``, ``logprobs``) and error bodies. No web framework here (``http_api.py``).

Which fields are honoured, accepted as hints, or refused unless "off" is ``request_fields.py``'s
table (vLLM's ``top_k``, ``ignore_eos``, ``stop_token_ids`` and ``cache_salt`` are honoured).
Every response also carries ``replica_group_id``, the group that served it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from services.common.errors import InvalidArgument, ShardlineError
from services.common.guided import InvalidGuide, grammar_of
from services.common.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from services.router.admission import context_error
from services.router.catalog import ServedModel
from services.router.chat import parse_messages
from services.router.protocol import (
    ChatCompletionRequest,
    CompletionFields,
    CompletionRequest,
    ResponseFormat,
    SamplingFields,
    validate,
)
from services.router.request_fields import BadRequest, check_fields
from services.router.tools import ToolCalling, parse_tool_calling
from services.router.tools import message as tool_message
from services.router.types import Finished, GenerationRequest, Scored, TokenOut

SEED_SPACE = 2**64  # choice i of a request with seed s samples with seed (s + i) mod 2**64

# A chat request without max_tokens may use the rest of the context, up to this many tokens:
# the router reserves KV for max_tokens up front, so "the whole context" would reserve it all.
DEFAULT_CHAT_MAX_TOKENS = 1024


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids",
                   "logprobs", "ignore_eos", "cache_salt", "prompt", "messages", "model", "min_p", "logit_bias",
                   "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty")


def error_status(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and OpenAI error type the error's class names (500 for anything else)."""
    if isinstance(exc, ShardlineError):
        return exc.http_status, exc.openai_type
    return ShardlineError.http_status, ShardlineError.openai_type


def error_code(exc: BaseException, status: int) -> str | None:
    message = str(exc)
    if status == 400 and ("maximum context length" in message or "needs KV cache" in message):
        return "context_length_exceeded"
    return {400: "invalid_value", 401: "invalid_api_key", 404: "model_not_found", 413: "payload_too_large",
            415: "unsupported_media_type", 429: "queue_full" if "full" in message else "queue_timeout",
            503: "no_healthy_replica"}.get(status)


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}`` and its HTTP status."""
    status, kind = error_status(exc)
    param = getattr(exc, "param", None)
    if param is None and isinstance(exc, InvalidArgument):
        first = str(exc).split(" ", 1)[0]
        param = first if first in SAMPLING_FIELDS else None
    message = str(exc) if isinstance(exc, ShardlineError) else f"internal error: {type(exc).__name__}: {exc}"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": error_code(exc, status)}}


# ---- requests ---------------------------------------------------------------------------
# Bodies are checked against ``protocol.py``'s models first (types, ranges: a 400 naming the
# field); what is read here are validated values, and the rules that tie fields together.


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (keys are strings in JSON) as ``((id, bias), ...)``."""
    out = []
    for key, bias in (raw or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise BadRequest(f"logit_bias: token {token} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        out.append((token, bias))
    return tuple(out)


GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def _response_format(value: ResponseFormat) -> tuple[str, str] | None:
    if value.type == "text":
        return None
    if value.type == "json_object":
        return "json_schema", '{"type": "object"}'
    if value.json_schema is None:
        raise BadRequest("response_format: a json_schema response format needs json_schema.schema, an object",
                         "response_format")
    return "json_schema", json.dumps(value.json_schema.schema_)


def _guide(req: SamplingFields) -> tuple[str, str] | None:
    """Structured outputs from OpenAI's ``response_format`` or vLLM's ``guided_json``,
    ``guided_regex`` and ``guided_choice`` (one of them), compiled once here so that a bad one is a
    400 before any stream."""
    given = [name for name in GUIDE_FIELDS if getattr(req, name) is not None]
    if len(given) > 1:
        raise BadRequest(f"only one of {', '.join(given)} may be given", given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        guide = _response_format(req.response_format)
    elif name == "guided_json":
        guide = "json_schema", req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
    elif name == "guided_regex":
        guide = "regex", req.guided_regex
    else:
        guide = "choice", json.dumps(req.guided_choice)
    return _compiled(guide, name, f"{name}: ")


def _compiled(guide: tuple[str, str] | None, param: str, what: str) -> tuple[str, str] | None:
    """``guide`` once it compiles, else a 400 naming ``param`` (the message starts with ``what``)."""
    if guide is not None:
        try:
            grammar_of(*guide)
        except InvalidGuide as exc:
            raise BadRequest(f"{what}{exc}", param) from None
    return guide


# the sampling fields that reach SamplingParams as they are; a null one keeps its default there
PLAIN_SAMPLING = ("temperature", "top_p", "seed", "min_p", "min_tokens", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "ignore_eos", "cache_salt")


def _sampling(req: SamplingFields, *, max_tokens: int, logprobs: int, vocab_size: int,
              guide: tuple[str, str] | None = None) -> SamplingParams:
    """The sampling fields; ``guide``: one the request's tool choice enforces (then no other may be given)."""
    asked = _guide(req)
    if guide is not None and asked is not None:
        raise BadRequest("tool_choice required or a named function constrains the output: no response_format or "
                         "guided field may be given with it", "tool_choice")
    plain = {name: value for name in PLAIN_SAMPLING if (value := getattr(req, name)) is not None}
    return SamplingParams(
        **plain, guide=guide or asked, logit_bias=_logit_bias(req.logit_bias, vocab_size),
        top_k=max(0, req.top_k or 0),  # vLLM spells "off" as -1
        max_tokens=max_tokens, stop=_stop(req.stop), stop_token_ids=tuple(req.stop_token_ids or ()),
        logprobs=logprobs)


@dataclass(frozen=True)
class ParsedRequest:
    request: GenerationRequest
    stream: bool
    include_usage: bool
    want_logprobs: bool  # chat: logprobs=true; completions: logprobs given
    echo: bool = False  # completions: the prompt's own tokens (and their logprobs) come first
    generate: bool = True  # False: echo with max_tokens 0, only the prompt is scored
    n: int = 1  # choices to answer with
    continuous_usage: bool = False  # streamed: every chunk carries its choice's usage so far
    best_of: int = 1  # candidates generated (completions); the n with the highest logprob sum are kept
    tools: ToolCalling | None = None  # chat: the tools and what the output must do with them


def _choice_counts(req: SamplingFields, stream: bool, *, best_of: bool) -> tuple[int, int]:
    """``n`` and (completions) ``best_of``: at least n, and above n only without streaming."""
    n = req.n or 1
    candidates = (req.best_of or n) if best_of else n
    if candidates < n:
        raise BadRequest(f"best_of must be at least n ({n}), got {candidates}", "best_of")
    if candidates > n and stream:
        raise BadRequest("best_of above n is served without streaming: send stream false", "best_of")
    return n, candidates


def choice_requests(parsed: ParsedRequest) -> list[ParsedRequest]:
    """One request per candidate choice (``best_of`` of them): the same request, each with its
    own seed when the request has one (choice i: seed + i, mod 2**64), so that every choice is
    reproducible on its own as an n=1 request with that seed."""
    out = []
    for i in range(parsed.best_of):
        sampling = parsed.request.sampling
        if sampling.seed is not None:
            sampling = replace(sampling, seed=(sampling.seed + i) % SEED_SPACE)
        out.append(replace(parsed, request=replace(parsed.request, sampling=sampling), n=1, best_of=1))
    return out


def _stream_flags(req: SamplingFields) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage`` (a usage chunk last) and vLLM's
    ``stream_options.continuous_usage_stats`` (every chunk carries its choice's usage so far)."""
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    if continuous and not include_usage:
        raise BadRequest("stream_options.continuous_usage_stats needs include_usage true", "stream_options")
    return bool(req.stream), include_usage, continuous


def parse_completion(body: dict[str, Any], model: ServedModel) -> ParsedRequest:
    """/v1/completions: ``prompt`` as a string, token ids, or a one-element list of either.
    ``echo`` (not streamed) puts the prompt first; with ``max_tokens: 0`` nothing is generated."""
    check_fields(body, "completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        body = {**body, "prompt": prompt[0]}
    elif isinstance(prompt, list) and len(prompt) > model.max_model_len and not isinstance(prompt[0], str | list):
        asked = body.get("max_tokens")  # too many ids to fit: said before each id is looked at
        raise context_error(model.max_model_len, len(prompt), asked if type(asked) is int else DEFAULT_MAX_TOKENS)
    return _completion(validate(CompletionRequest, body), model)


def _completion(req: CompletionFields, model: ServedModel) -> ParsedRequest:
    """One prompt's request from a validated body."""
    text: str | None = None
    ids: tuple[int, ...] | None = None
    if isinstance(req.prompt, str):
        text = req.prompt
    elif isinstance(req.prompt[0], int):
        ids = tuple(req.prompt)
    else:
        raise BadRequest("prompt: only one prompt per request (a string or a list of token ids)", "prompt")
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    echo = bool(req.echo)
    stream, include_usage, continuous = _stream_flags(req)
    if echo and stream:
        raise BadRequest("echo is served without streaming: send stream false", "echo")
    n, best_of = _choice_counts(req, stream, best_of=True)
    if echo and best_of > 1:
        raise BadRequest("echo is served with one choice: send n and best_of 1", "echo")
    generate = not (echo and max_tokens == 0)  # echo alone scores the prompt, as vLLM does
    sampling = _sampling(req, max_tokens=max_tokens if generate else 1, logprobs=req.logprobs or 0,
                         vocab_size=model.vocab_size)
    request = GenerationRequest(model=model.name, prompt_text=text, prompt_ids=ids, sampling=sampling)
    return ParsedRequest(request, stream, include_usage, req.logprobs is not None, echo=echo, generate=generate,
                         n=n, best_of=best_of, continuous_usage=continuous)


def parse_completions(body: dict[str, Any], model: ServedModel) -> list[ParsedRequest]:
    """/v1/completions with one prompt or several: ``prompt`` as a list of strings or of token-id
    lists (OpenAI's and vLLM's batch form, which lm-eval's ``local-completions`` sends with
    ``batch_size`` > 1) is one request per prompt, answered as one choice each (``index`` is the
    prompt's position). Several prompts are not streamed."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)
    if not several:
        return [parse_completion(body, model)]
    check_fields(body, "completions")
    req = validate(CompletionRequest, body)  # once: each prompt's request is a copy with its prompt
    if req.stream:
        raise BadRequest("several prompts are served without streaming: send stream false", "stream")
    return [_completion(req.model_copy(update={"prompt": p}), model) for p in req.prompt]


def chat_prompt_ids(raw_messages: Any, model: ServedModel, *, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, release_gil: bool = False,
                    tools: ToolCalling | None = None) -> list[int]:
    """OpenAI ``messages`` (and ``tools``) rendered with the model's chat template and tokenized (by
    default without adding special tokens: the template spells them); a bad message is a 400
    naming ``messages``."""
    try:
        messages = parse_messages(raw_messages)
    except InvalidArgument as exc:
        raise BadRequest(str(exc), "messages") from None
    prompt = model.render_chat(messages, add_generation_prompt=add_generation_prompt,
                               tools=list(tools.tools) if tools is not None else None)
    try:
        return model.encode(prompt, add_special_tokens=add_special_tokens, release_gil=release_gil)
    except BadRequest:
        raise
    except InvalidArgument as exc:  # the rendered prompt cannot fit the context
        raise BadRequest(f"messages: {exc}", "messages") from None


def parse_chat(body: dict[str, Any], model: ServedModel, *, token_limit: int,
               release_gil: bool = False) -> ParsedRequest:
    """/v1/chat/completions: render the messages with the model's chat template, as
    transformers' ``apply_chat_template(add_generation_prompt=True)`` does, then tokenize without
    adding special tokens (the template spells them). ``token_limit`` is the most tokens any group
    could hold, which bounds the default max_tokens. ``release_gil``: the caller is off the event
    loop (a large request), so tokenize letting go of the GIL."""
    check_fields(body, "chat")
    req = validate(ChatCompletionRequest, body)
    tools = parse_tool_calling(body, model.tool_call_parser)
    ids = chat_prompt_ids(body["messages"], model, release_gil=release_gil, tools=tools)
    if not ids:
        raise BadRequest("messages must not render to an empty prompt", "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        room = min(model.max_model_len, token_limit or model.max_model_len) - len(ids)
        max_tokens = max(1, min(DEFAULT_CHAT_MAX_TOKENS, room))
    want_logprobs = bool(req.logprobs)
    guide = _compiled(tools.guide() if tools is not None else None, "tools",
                      "tools: a function's parameters are not a usable JSON schema: ")
    sampling = _sampling(req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if want_logprobs else 0,
                         vocab_size=model.vocab_size, guide=guide)
    stream, include_usage, continuous = _stream_flags(req)
    n, _ = _choice_counts(req, stream, best_of=False)
    request = GenerationRequest(model=model.name, prompt_ids=tuple(ids), sampling=sampling)
    return ParsedRequest(request, stream, include_usage, want_logprobs, n=n, best_of=n, continuous_usage=continuous,
                         tools=tools)


# ---- responses --------------------------------------------------------------------------


def usage(finished: Finished) -> dict[str, int]:
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens}


def completion_logprobs(tokens: list[TokenOut], offset0: int = 0) -> dict[str, Any]:
    """The completions API's logprobs: parallel lists per token."""
    offsets, at = [], offset0
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.token_text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.text: a.logprob for a in t.top_logprobs} for t in tokens],
            "text_offset": offsets}


def echo_completion_response(head: ResponseHeader, scored: Scored, prompt_text: str, tokens: list[TokenOut],
                             finished: Finished, want_logprobs: bool) -> dict[str, Any]:
    """A completion that starts with its prompt (``echo``): the text is prompt + generation, and
    the logprobs cover the prompt's tokens first (the first one ``null``: nothing precedes it)."""
    logprobs = None
    if want_logprobs:
        generated = completion_logprobs(tokens, offset0=len(prompt_text))
        offsets, at = [], 0
        for text in scored.token_texts:
            offsets.append(at)
            at += len(text)
        logprobs = {"tokens": scored.token_texts + generated["tokens"],
                    "token_logprobs": [None, *scored.logprobs, *generated["token_logprobs"]],
                    "top_logprobs": [None, *({a.text: a.logprob for a in at} for at in scored.top_logprobs),
                                     *generated["top_logprobs"]],
                    "text_offset": offsets + generated["text_offset"]}
    completion_tokens = finished.completion_tokens
    return {**head.base("text_completion"), "choices": [{
        "index": 0, "text": prompt_text + finished.text, "finish_reason": finished.reason.openai,
        "stop_reason": finished.stop_sequence, "logprobs": logprobs}],
        "usage": {"prompt_tokens": len(scored.token_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(scored.token_ids) + completion_tokens}}


def several_completions_response(answers: list[dict[str, Any]], *, per_prompt: int = 1) -> dict[str, Any]:
    """One answer of several choices (several prompts, ``per_prompt`` choices each, in order):
    ``index`` is the choice's position, as OpenAI numbers them; usage counts each prompt once and
    every choice's completion; the id is the first choice's, the group the last one's."""
    choices = [{**answer["choices"][0], "index": i} for i, answer in enumerate(answers)]
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers[::per_prompt])
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    totals = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {**answers[0], "replica_group_id": answers[-1]["replica_group_id"], "choices": choices, "usage": totals}


def chat_logprobs(tokens: list[TokenOut]) -> dict[str, Any]:
    """The chat API's logprobs: one entry per token, with its bytes and alternatives."""
    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(t.token_text, t.logprob),
                         "top_logprobs": [entry(a.text, a.logprob) for a in t.top_logprobs]} for t in tokens]}


@dataclass
class ResponseHeader:
    """The fields every object of one response shares."""

    id: str
    model: str
    replica_group_id: str
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "replica_group_id": self.replica_group_id}


def completion_response(head: ResponseHeader, tokens: list[TokenOut], finished: Finished,
                        want_logprobs: bool) -> dict[str, Any]:
    return {**head.base("text_completion"), "choices": [{
        "index": 0, "text": finished.text, "finish_reason": finished.reason.openai,
        "stop_reason": finished.stop_sequence,
        "logprobs": completion_logprobs(tokens) if want_logprobs else None}], "usage": usage(finished)}


def answer(head: ResponseHeader, tokens: list[TokenOut], finished: Finished, parsed: ParsedRequest, *,
           chat: bool) -> dict[str, Any]:
    """A non-streamed answer of one choice: a chat completion or a completion."""
    return chat_response(head, tokens, finished, parsed.want_logprobs, parsed.tools) if chat else \
        completion_response(head, tokens, finished, parsed.want_logprobs)


def chat_response(head: ResponseHeader, tokens: list[TokenOut], finished: Finished,
                  want_logprobs: bool, tools: ToolCalling | None = None) -> dict[str, Any]:
    """A chat answer; with ``tools``, the text read for calls (``tools.message``)."""
    message, reason = tool_message(tools, finished.text, finished.reason.openai)
    return {**head.base("chat.completion"), "choices": [{
        "index": 0, "message": message, "finish_reason": reason, "stop_reason": finished.stop_sequence,
        "logprobs": chat_logprobs(tokens) if want_logprobs else None}], "usage": usage(finished)}


def completion_chunk(head: ResponseHeader, text: str, *, finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None, index: int = 0,
                     stop_reason: str | None = None) -> dict[str, Any]:
    return {**head.base("text_completion"),
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}]}


def chat_chunk(head: ResponseHeader, delta: dict[str, Any], *, finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None, index: int = 0,
               stop_reason: str | None = None) -> dict[str, Any]:
    return {**head.base("chat.completion.chunk"),
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}]}


def usage_chunk(head: ResponseHeader, obj: str, finished: Finished, *, completion_tokens: int | None = None) -> \
        dict[str, Any]:
    """The usage chunk; ``completion_tokens``: the sum over a request's choices (default: this one's)."""
    body = usage(finished)
    if completion_tokens is not None:
        body = {**body, "completion_tokens": completion_tokens,
                "total_tokens": body["prompt_tokens"] + completion_tokens}
    return {**head.base(obj), "choices": [], "usage": body}
