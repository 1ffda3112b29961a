"""Every field of OpenAI's completions and chat completions request bodies (and the sampling
extensions vLLM users send), with what the router does with it.

A field is one of:

- ``honoured``: parsed and applied (``openai_format.py`` reads it);
- ``hint``: accepted, with no effect on the output: an identifier (``user``), a hint about
  caching or latency that the server is free to use or not (``prompt_cache_key``, ``prediction``);
- ``unsupported``: not implemented here. Sent with a value that means "off" (``n: 1``,
  ``presence_penalty: 0``, ``response_format: {"type": "text"}``, null) it is accepted, since it
  asks for nothing; any other value is a 400 naming the field, never a 200 that silently does
  something else than asked.

Fields that no list here names are ignored, as OpenAI's own servers ignore them. The table is
the one place these rules live: the parser checks bodies against it, the OpenAPI document
describes each field from it, and docs/openai.md lists it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from services.common.errors import InvalidArgument

Endpoint = Literal["completions", "chat"]
BOTH: tuple[Endpoint, ...] = ("completions", "chat")
COMPLETIONS: tuple[Endpoint, ...] = ("completions",)
CHAT: tuple[Endpoint, ...] = ("chat",)


class BadRequest(InvalidArgument):
    """A bad request field; ``param`` names it in the error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedField(BadRequest):
    """A known field sent with a value that asks for something this server does not do."""


@dataclass(frozen=True)
class RequestField:
    name: str
    endpoints: tuple[Endpoint, ...]
    status: Literal["honoured", "hint", "unsupported"]
    off: tuple[Any, ...] = ()  # unsupported: the values that ask for nothing (null always does)
    note: str = ""

    def check(self, value: Any) -> None:
        """Raise :class:`UnsupportedField` when an unsupported field asks for something."""
        if self.status != "unsupported" or value is None or any(_same(value, o) for o in self.off):
            return
        only = f" (only {' or '.join(_show(o) for o in self.off)})" if self.off else ""
        raise UnsupportedField(f"{self.name} is not supported{only}, got {_show(value)}"
                               + (f": {self.note}" if self.note else ""), self.name)


def _same(value: Any, off: Any) -> bool:
    """``value`` equals ``off`` without Python's bool/int mixing (``True`` is not 1 here)."""
    if isinstance(value, bool) or isinstance(off, bool):
        return type(value) is type(off) and value == off
    if isinstance(off, int | float):
        return isinstance(value, int | float) and value == off
    return value == off


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_F = RequestField
FIELDS: tuple[RequestField, ...] = (
    # -- honoured (openai_format.py) -------------------------------------------------------
    _F("model", BOTH, "honoured", note="the served model's name; empty: the only one served"),
    _F("prompt", COMPLETIONS, "honoured", note="a string, token ids, or a list of either (one choice each)"),
    _F("messages", CHAT, "honoured", note="text content; rendered with the model's chat template"),
    _F("max_tokens", BOTH, "honoured"),
    _F("max_completion_tokens", CHAT, "honoured"),
    _F("temperature", BOTH, "honoured"),
    _F("top_p", BOTH, "honoured"),
    _F("top_k", BOTH, "honoured", note="vLLM's; 0 or -1: off"),
    _F("seed", BOTH, "honoured", note="the request's own sampling stream, reproducible on any group"),
    _F("stop", BOTH, "honoured", note="matched by the router over the whole text (across a failover too); the "
                                      "choice's `stop_reason` (vLLM's field) names the string that matched"),
    _F("stop_token_ids", BOTH, "honoured", note="vLLM's"),
    _F("ignore_eos", BOTH, "honoured", note="vLLM's"),
    _F("logprobs", BOTH, "honoured", note="completions: an integer; chat: a boolean"),
    _F("top_logprobs", CHAT, "honoured"),
    _F("echo", COMPLETIONS, "honoured", note="not streamed; with max_tokens 0 only the prompt is scored"),
    _F("response_format", BOTH, "honoured", note="text, json_object, json_schema (llguidance masks)"),
    _F("guided_json", BOTH, "honoured", note="vLLM's: a JSON schema"),
    _F("guided_regex", BOTH, "honoured", note="vLLM's: the whole output matches it"),
    _F("guided_choice", BOTH, "honoured", note="vLLM's: the output is one of the strings"),
    _F("n", BOTH, "honoured", note="up to 16 choices; with seed s, choice i samples with seed s + i"),
    _F("best_of", COMPLETIONS, "honoured", note="candidates, the n of highest logprob sum kept; not streamed"),
    _F("stream", BOTH, "honoured"),
    _F("stream_options", BOTH, "honoured", note="include_usage; vLLM's continuous_usage_stats"),
    _F("cache_salt", BOTH, "honoured", note="vLLM's: prefix-cache hits only among requests of the same salt"),
    _F("logit_bias", BOTH, "honoured", note="added before the choice, greedy included; logprobs stay the model's"),
    _F("min_p", BOTH, "honoured", note="vLLM's; after temperature, before top-k/top-p; 0: off"),
    _F("min_tokens", BOTH, "honoured", note="vLLM's: EOS and stop_token_ids are not sampled before it"),
    _F("presence_penalty", BOTH, "honoured", note="over the generated tokens, greedy included"),
    _F("frequency_penalty", BOTH, "honoured", note="over the generated tokens, greedy included"),
    _F("repetition_penalty", BOTH, "honoured", note="vLLM's, over prompt and generated tokens; 1: off"),
    _F("tools", CHAT, "honoured", note="function tools; they reach the chat template"),
    _F("tool_choice", CHAT, "honoured",
       note="none, auto (--tool-call-parser reads the calls), required and a named function (JSON-schema guided)"),
    _F("parallel_tool_calls", CHAT, "honoured", note="false: tool_choice required makes exactly one call"),
    # -- hints: accepted, no effect on the output ------------------------------------------
    _F("user", BOTH, "hint", note="an end-user identifier"),
    _F("safety_identifier", CHAT, "hint", note="an end-user identifier"),
    _F("metadata", CHAT, "hint", note="tags for stored completions; nothing is stored"),
    _F("prompt_cache_key", CHAT, "hint", note="prefix caching is automatic (block hashes)"),
    _F("prompt_cache_retention", CHAT, "hint", note="cached blocks live until KV pressure evicts them"),
    _F("prompt_cache_options", CHAT, "hint", note="prefix caching is automatic"),
    _F("prediction", CHAT, "hint", note="predicted outputs only speed a response up; not used"),
    # -- unsupported: a 400 unless "off" ---------------------------------------------------
    _F("suffix", COMPLETIONS, "unsupported", ("",)),
    _F("guided_grammar", BOTH, "unsupported", note="vLLM's; grammars: use guided_regex or a JSON schema"),
    _F("structured_outputs", BOTH, "unsupported", note="vLLM >= 0.11's spelling: use guided_json/regex/choice"),
    _F("functions", CHAT, "unsupported", ([],), "deprecated by OpenAI: send tools"),
    _F("function_call", CHAT, "unsupported", ("none", "auto"), "deprecated by OpenAI: send tool_choice"),
    _F("audio", CHAT, "unsupported", note="text only"),
    _F("modalities", CHAT, "unsupported", (["text"],), "text only"),
    _F("web_search_options", CHAT, "unsupported"),
    _F("moderation", CHAT, "unsupported"),
    _F("store", CHAT, "unsupported", (False,), "nothing is stored"),
    _F("service_tier", CHAT, "unsupported", ("auto", "default")),
    _F("reasoning_effort", CHAT, "unsupported", note="the served models do not reason"),
    _F("verbosity", CHAT, "unsupported", ("medium",)),
    _F("include_stop_str_in_output", BOTH, "unsupported", (False,), "vLLM's"),
    _F("skip_special_tokens", BOTH, "unsupported", (True,), "vLLM's; special tokens are always skipped"),
    _F("add_generation_prompt", CHAT, "unsupported", (True,), "vLLM's"),
    _F("continue_final_message", CHAT, "unsupported", (False,), "vLLM's"),
    _F("chat_template", CHAT, "unsupported", note="vLLM's; the router's --chat-template sets it per model"),
    _F("chat_template_kwargs", CHAT, "unsupported", ({},), "vLLM's"),
)

BY_ENDPOINT: dict[Endpoint, dict[str, RequestField]] = {
    endpoint: {f.name: f for f in FIELDS if endpoint in f.endpoints} for endpoint in ("completions", "chat")}


def check_fields(body: dict[str, Any], endpoint: Endpoint) -> None:
    """400 (:class:`UnsupportedField`) for the first field of ``body`` that asks for what this
    server does not do; fields of the other endpoint are checked under their own rule too (a
    chat field on completions is no more honoured there)."""
    known = BY_ENDPOINT[endpoint]
    for name, value in body.items():
        field = known.get(name)
        if field is None:
            other = next((f for f in FIELDS if f.name == name), None)
            if other is None:
                continue  # unknown: ignored, as OpenAI does
            if other.status == "honoured" and value:  # null, false, 0, empty: asks for nothing
                raise UnsupportedField(f"{name} is a {' and '.join(other.endpoints)} parameter", name)
            field = other
        field.check(value)


def markdown_table() -> str:
    """The table as docs/openai.md lists it (tests/router/test_request_fields.py keeps the two equal):
    ``python -c 'from services.router.request_fields import markdown_table; print(markdown_table())'``."""
    lines = ["| field | endpoint | status |", "|---|---|---|"]
    for f in FIELDS:
        where = "both" if len(f.endpoints) == 2 else f.endpoints[0]
        if f.status == "honoured":
            status = "honoured" + (f": {f.note}" if f.note else "")
        elif f.status == "hint":
            status = f"accepted, no effect: {f.note}"
        else:
            offs = " or ".join(f"`{json.dumps(o)}`" for o in f.off)
            status = "400 unless null" + (f" or {offs}" if offs else "") + (f": {f.note}" if f.note else "")
        lines.append(f"| `{f.name}` | {where} | {status} |")
    return "\n".join(lines) + "\n"
