"""The OpenAPI 3.1 document of the router's HTTP API, served at ``GET /openapi.json``.

Written by hand, next to what it describes: the request bodies ``openai_format.py`` parses (it
validates them itself, so its 400s keep OpenAI's error body; the hints and unsupported fields come
from ``request_fields.py``'s table), the objects it builds, the SSE
chunks (``text/event-stream``: each event's ``data:`` is one of the chunk schemas, the last one
is ``[DONE]``) and OpenAI's ``{"error": {...}}``. tests/router/test_openapi.py fuzzes the server
against it, so a field added on one side and not the other fails there.
"""

from __future__ import annotations

from typing import Any

from services.common.sampling import (
    MAX_CACHE_SALT_CHARS,
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    MAX_UINT32,
)
from services.router.openai_format import MAX_CHOICES, MAX_PROMPTS
from services.router.request_fields import BY_ENDPOINT, Endpoint

_INT = {"type": "integer"}
_STR = {"type": "string"}
_NUM = {"type": "number"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _obj(properties: dict[str, Any], required: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), **extra}


_STOP = _nullable({"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "string", "minLength": 1}}]})
_STREAM_OPTIONS = _nullable(_obj({"include_usage": {"type": "boolean"},
                                  "continuous_usage_stats": {"type": "boolean", "description":
                                                             "vLLM's: usage in every chunk; needs include_usage"}}))

# The sampling fields both endpoints take (vLLM's extensions included), with the ranges
# services.common.sampling enforces.
_SAMPLING: dict[str, Any] = {
    "model": _nullable(_STR),
    "temperature": _nullable({"type": "number", "minimum": 0}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": MAX_UINT32,
                        "description": "0 or -1: off"}),
    "seed": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_SEED}),
    "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_INT32}),
    "stop": _STOP,
    "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                            "maximum": MAX_UINT32}}),
    "ignore_eos": _nullable({"type": "boolean"}),
    "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                             "description": "share cached prompt prefixes only with requests of this salt"}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1, "description": "vLLM's; 0: off"}),
    "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS_TOKENS,
                             "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                      "maximum": MAX_LOGIT_BIAS},
                             "description": "token id (as a string) -> bias added to its logit"}),
    "min_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_INT32,
                             "description": "vLLM's; at most max_tokens"}),
    "presence_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 100,
                                     "description": "vLLM's; 1: off"}),
    "response_format": _nullable(_obj({
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": _obj({"name": _STR, "schema": {"type": "object"}, "strict": _nullable({"type": "boolean"}),
                             "description": _STR}, ("schema",))}, ("type",))),
    "guided_json": _nullable({"anyOf": [{"type": "object"}, _STR], "description": "vLLM's: a JSON schema"}),
    "guided_regex": _nullable({**_STR, "description": "vLLM's: the whole output matches it"}),
    "guided_choice": _nullable({"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
                    "description": "choices; with seed s, choice i samples with seed s + i (mod 2**64)"}),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _STREAM_OPTIONS,
}


def _table_fields(endpoint: Endpoint) -> dict[str, Any]:
    """The hints and the unsupported fields of ``request_fields.py``'s table: a hint takes any
    value; an unsupported field only null or a value that asks for nothing."""
    out: dict[str, Any] = {}
    for field in BY_ENDPOINT[endpoint].values():
        if field.status == "hint":
            out[field.name] = {"description": f"accepted, no effect: {field.note}"}
        elif field.status == "unsupported":
            what = "not supported" + (f": {field.note}" if field.note else "")
            out[field.name] = ({"anyOf": [{"enum": list(field.off)}, {"type": "null"}], "description": what}
                               if field.off else {"type": "null", "description": what})
    return out

_PROMPT = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": _INT, "minItems": 1, "description": "token ids"},
    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "description": "several prompts: one choice each, "
     "index its position; not with stream",
     "items": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": _INT, "minItems": 1}]}},
]}

_TEXT_PART = _obj({"type": {"const": "text"}, "text": _STR}, ("type", "text"))
_CONTENT = {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]}
_FUNCTION_CALL = _obj({"name": _STR, "arguments": {**_STR, "description": "JSON text"}}, ("name", "arguments"))
_TOOL_CALL = _obj({"id": _STR, "type": {"const": "function"}, "function": _FUNCTION_CALL}, ("id", "type", "function"))
_MESSAGE = {"oneOf": [
    _obj({"role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT,
          "name": _STR}, ("role", "content")),
    _obj({"role": {"const": "tool"}, "content": _CONTENT, "tool_call_id": _STR}, ("role", "content", "tool_call_id")),
    _obj({"role": {"const": "assistant"}, "content": _nullable(_CONTENT), "name": _STR,
          "tool_calls": _nullable({"type": "array", "items": _TOOL_CALL})}, ("role",)),
]}
_TOOL_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
_TOOLS = {
    "tools": _nullable({"type": "array", "items": _obj({
        "type": {"const": "function"},
        "function": _obj({"name": _TOOL_NAME, "description": _STR, "strict": _nullable({"type": "boolean"}),
                          "parameters": {"type": "object", "description": "a JSON schema"}}, ("name",))},
        ("type", "function")), "description": "function tools, unique names; they reach the chat template"}),
    "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, _obj({
        "type": {"const": "function"}, "function": _obj({"name": _TOOL_NAME}, ("name",))}, ("type", "function"))],
        "description": "required and a named function need tools; they guide the output with the parameters' "
                       "JSON schema"}),
    "parallel_tool_calls": _nullable({"type": "boolean", "description": "false: required makes one call"}),
}

_BASE = {"id": _STR, "created": _INT, "model": _STR, "replica_group_id": _STR}
_USAGE = _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
              ("prompt_tokens", "completion_tokens", "total_tokens"))
_FINISH = _nullable({"enum": ["stop", "length", "abort", "tool_calls"]})
_COMPLETION_LOGPROBS = _nullable(_obj({
    "tokens": {"type": "array", "items": _STR},
    "token_logprobs": {"type": "array", "items": _nullable(_NUM), "description": "null: an echoed first token"},
    "top_logprobs": {"type": "array", "items": _nullable({"type": "object", "additionalProperties": _NUM})},
    "text_offset": {"type": "array", "items": _INT}}, ("tokens", "token_logprobs", "top_logprobs", "text_offset")))
_TOKEN_LOGPROB = _obj({"token": _STR, "logprob": _NUM, "bytes": {"type": "array", "items": _INT}},
                      ("token", "logprob", "bytes"))
_CHAT_LOGPROBS = _nullable(_obj({"content": {"type": "array", "items": _obj({
    **_TOKEN_LOGPROB["properties"], "top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB}},
    ("token", "logprob", "bytes", "top_logprobs"))}}, ("content",)))


def _response(obj: str, choice: dict[str, Any], *, usage: bool, chunk: bool = False) -> dict[str, Any]:
    properties = {**_BASE, "object": {"const": obj},
                  "choices": {"type": "array", "items": choice, **({} if chunk else {"minItems": 1})}}
    if usage:
        properties["usage"] = _USAGE
    required = ("id", "object", "created", "model", "replica_group_id", "choices", *(("usage",) if usage and
                                                                                    not chunk else ()))
    return _obj(properties, required)


SCHEMAS: dict[str, Any] = {
    "Error": _obj({"error": _obj({"message": _STR, "type": _STR, "param": _nullable(_STR),
                                  "code": _nullable(_STR)}, ("message", "type", "param", "code"))}, ("error",)),
    "Health": _obj({"status": {"enum": ["ok", "unavailable"]}, "replica_groups": _INT,
                    "healthy_replica_groups": _INT}, ("status", "replica_groups", "healthy_replica_groups")),
    "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _obj({
        "id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "max_model_len": _INT},
        ("id", "object", "created", "owned_by", "max_model_len"))}}, ("object", "data")),
    "CompletionRequest": _obj({**_table_fields("completions"), **_SAMPLING, "prompt": _PROMPT,
                               "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
                               "max_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_INT32,
                                                        "description": "0 only with echo: score the prompt"}),
                               "echo": _nullable({"type": "boolean", "description":
                                                  "the prompt and its logprobs first; not with stream"}),
                               "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
                                                     "description": "candidates (at least n): the n of highest "
                                                                    "logprob sum are answered; not with stream"})},
                              ("prompt",)),
    "ChatCompletionRequest": _obj({**_table_fields("chat"), **_SAMPLING, **_TOOLS,
                                   "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
                                   "max_completion_tokens": _nullable({"type": "integer", "minimum": 1,
                                                                       "maximum": MAX_INT32}),
                                   "logprobs": _nullable({"type": "boolean"}),
                                   "top_logprobs": _nullable({"type": "integer", "minimum": 0,
                                                              "maximum": MAX_LOGPROBS})},
                                  ("messages",)),
    "TokenizeRequest": _obj({
        "model": _nullable(_STR), "prompt": _nullable({**_STR, "description": "either prompt or messages"}),
        "messages": _nullable({"type": "array", "items": _MESSAGE, "minItems": 1}),
        "add_special_tokens": _nullable({"type": "boolean", "description": "default: true for prompt, false for "
                                                                          "messages"}),
        "add_generation_prompt": _nullable({"type": "boolean", "description": "messages: default true"}),
        "return_token_strs": _nullable({"type": "boolean"})}),
    "TokenizeResponse": _obj({"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT},
                              "token_strs": _nullable({"type": "array", "items": _STR})},
                             ("count", "max_model_len", "tokens", "token_strs")),
    "DetokenizeRequest": _obj({"model": _nullable(_STR), "tokens": {"type": "array", "items": _INT}}, ("tokens",)),
    "DetokenizeResponse": _obj({"prompt": _STR}, ("prompt",)),
    "Version": _obj({"version": _STR}, ("version",)),
    "Completion": _response("text_completion", _obj({
        "index": _INT, "text": _STR, "finish_reason": _FINISH, "logprobs": _COMPLETION_LOGPROBS},
        ("index", "text", "finish_reason", "logprobs")), usage=True),
    "ChatCompletion": _response("chat.completion", _obj({
        "index": _INT, "message": _obj({"role": {"const": "assistant"}, "content": _nullable(_STR),
                                        "tool_calls": {"type": "array", "items": _TOOL_CALL}}, ("role", "content")),
        "finish_reason": _FINISH, "logprobs": _CHAT_LOGPROBS}, ("index", "message", "finish_reason", "logprobs")),
        usage=True),
    "CompletionChunk": _response("text_completion", _obj({
        "index": _INT, "text": _STR, "finish_reason": _FINISH, "logprobs": _COMPLETION_LOGPROBS},
        ("index", "text", "finish_reason", "logprobs")), usage=True, chunk=True),
    "ChatCompletionChunk": _response("chat.completion.chunk", _obj({
        "index": _INT, "delta": _obj({"role": {"const": "assistant"}, "content": _STR, "tool_calls": {
            "type": "array", "items": _obj({"index": _INT, "id": _STR, "type": {"const": "function"},
                                            "function": _obj({"name": _STR, "arguments": _STR})}, ("index",))}}),
        "finish_reason": _FINISH, "logprobs": _CHAT_LOGPROBS}, ("index", "delta", "finish_reason", "logprobs")),
        usage=True, chunk=True),
}

_ERROR_STATUSES = {"400": "invalid request (a field, the JSON, the context length)",
                   "401": "missing or wrong API key", "404": "unknown model",
                   "413": "body over --max-body-bytes", "415": "Content-Type is not application/json",
                   "429": "admission queue full, or its wait timed out",
                   "503": "no healthy replica group"}


def _errors(*codes: str) -> dict[str, Any]:
    return {c: {"description": _ERROR_STATUSES[c], "content": {"application/json": {"schema": _ref("Error")}}}
            for c in codes}


def _sse_event(chunk: str) -> dict[str, Any]:
    """One Server-Sent Event, as OpenAPI 3.1 reads ``schema`` under ``text/event-stream``: its
    ``data`` is the chunk (or an Error) as JSON text, and the last one is ``[DONE]``."""
    return _obj({"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}}]}}, ("data",))


def _generate(request: str, response: str, chunk: str, summary: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": f"{response}; with stream: Server-Sent Events, each `data:` a {chunk} "
                                   f"(or an Error, if the stream fails), then `data: [DONE]`",
                    "headers": {"x-shardline-replica-group-id": {"schema": _STR}},
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": _sse_event(chunk)}}},
            **_errors("400", "401", "404", "413", "415", "429", "503")}}}


def _post(request: str, response: str, summary: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": response, "content": {"application/json": {"schema": _ref(response)}}},
                      **_errors("400", "401", "404", "413", "415")}}}


def openapi_document(*, title: str = "shardline router") -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1", "description": "OpenAI-compatible HTTP API of the shardline router"},
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _generate("CompletionRequest", "Completion", "CompletionChunk", "Text completion"),
            "/v1/chat/completions": _generate("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk",
                                              "Chat completion"),
            "/tokenize": _post("TokenizeRequest", "TokenizeResponse",
                               "A prompt's or a chat's token ids, as a completion or chat request would send them"),
            "/detokenize": _post("DetokenizeRequest", "DetokenizeResponse", "Token ids as text"),
            "/version": {"get": {"summary": "The server's version", "responses": {
                "200": {"description": "the version", "content": {"application/json": {"schema": _ref("Version")}}}}}},
            "/v1/models": {"get": {"summary": "Served models", "responses": {
                "200": {"description": "the models", "content": {"application/json": {"schema": _ref("ModelList")}}},
                **_errors("401")}}},
            "/health": {"get": {"summary": "200 while a replica group takes requests, else 503", "responses": {
                code: {"description": what, "content": {"application/json": {"schema": _ref("Health")}}}
                for code, what in (("200", "serving"), ("503", "no healthy replica group"))}}},
        },
    }
