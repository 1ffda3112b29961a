"""The OpenAPI 3.1 document of the router's HTTP API, served at ``GET /openapi.json``.

Its schemas are ``protocol.py``'s models (the ones the router validates request bodies with, and
the objects it answers with); what is written here is the HTTP around them: the paths, the
status codes and their meaning, the SSE framing (``text/event-stream``: each event's ``data:``
is one of the chunk schemas, the last one is ``[DONE]``). tests/router/test_openapi.py fuzzes
the server against the document, so a field added on one side and not the other fails there.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from services.router.protocol import DOCUMENTED

_STR = {"type": "string"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required)}


def schemas() -> dict[str, Any]:
    """Every documented model's JSON schema, and those of the models they hold, by class name."""
    _, document = models_json_schema([(m, "validation") for m in DOCUMENTED],
                                     ref_template="#/components/schemas/{model}")
    return document["$defs"]


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
        "components": {"schemas": schemas(),
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
