"""Tool calling on /v1/chat/completions: ``tools`` and ``tool_choice`` as OpenAI serves them.

The request's tools reach the chat template (its ``tools`` variable, as transformers passes
them), and the history may hold assistant ``tool_calls`` and ``tool`` results. What the model
writes becomes ``tool_calls`` by ``tool_choice``:

- ``none``: plain text, never a call;
- ``auto``: the model decides; its text is read for calls in its template's syntax, chosen by the
  router's ``--tool-call-parser`` (``hermes``: ``<tool_call>{"name": ..., "arguments": ...}
  </tool_call>`` blocks; ``llama3_json``: a bare ``{"name": ..., "parameters": ...}`` object, or
  several joined by ``;``); text before the first call is the message's content;
- ``required``: at least one call (exactly one with ``parallel_tool_calls: false``), enforced with
  a JSON-schema guide over ``[{"name": ..., "parameters": ...}]`` where each name carries its own
  function's parameter schema;
- a named function: the output is that function's arguments, guided by its parameter schema.

A call's ``arguments`` is JSON text, as OpenAI sends it. A stream sends calls as ``tool_calls``
deltas: a named function's arguments as they are generated, other calls once their text is
complete (the client's accumulated message is the same). ``finish_reason`` is ``tool_calls``
when calls were made, ``stop`` for a named function (as OpenAI answers), ``length`` when the
tokens ran out first (then the text is returned as content, a cut call cannot be parsed; a named
function's call is still the call, its arguments cut, as its stream sent them).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.router.request_fields import BadRequest

PARSERS = ("hermes", "llama3_json")
DEFAULT_PARSER = "hermes"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_HERMES_OPEN, _HERMES_CALL = "<tool_call>", re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools and how the output must use them."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {...}}, as sent (for the template)
    choice: str  # none, auto, required, or function (the one named in ``function``)
    function: str | None = None
    parser: str = DEFAULT_PARSER
    parallel: bool = True

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object", "properties": {}}
        raise KeyError(name)

    def guide(self) -> tuple[str, str] | None:
        """The JSON-schema guide that enforces ``required`` or a named function (else None)."""
        if self.choice == "function":
            return "json_schema", json.dumps(self.parameters(self.function))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": self.parameters(t["function"]["name"])},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return "json_schema", json.dumps(schema)


def parse_tool_calling(body: dict[str, Any], parser: str) -> ToolCalling | None:
    """The request's tools and tool choice (None without tools: ``tool_choice`` may then only say
    none or auto); BadRequest names the bad field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of function tools", "tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise BadRequest(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}", "tools")
        if name in names:
            raise BadRequest(f"tools[{i}]: two tools are named {name!r}", "tools")
        if not isinstance(function.get("parameters") or {}, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(name)
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolCalling(tuple(tools), choice or "auto", parser=parser, parallel=parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise BadRequest("tool_choice must be none, auto, required or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", "tool_choice")
    if named not in names:
        raise BadRequest(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
    return ToolCalling(tuple(tools), "function", named, parser, parallel)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def _json_calls(text: str, arguments_key: str) -> list[ToolCall] | None:
    """Calls in JSON text: one object, a list of them, or objects joined by ``;``; None if any part
    is not a call."""
    calls: list[ToolCall] = []
    for part in (text.split(";") if not text.lstrip().startswith("[") else [text]):
        try:
            value = json.loads(part)
        except json.JSONDecodeError:
            return None
        for obj in value if isinstance(value, list) else [value]:
            if (call := _call(obj, arguments_key)) is None:
                return None
            calls.append(call)
    return calls or None


def split_calls(calling: ToolCalling, text: str) -> tuple[str | None, list[ToolCall]]:
    """The message's content and its calls, from the whole generated text (no calls: the text)."""
    if calling.choice == "none":
        return text, []
    if calling.choice == "function":
        return None, [ToolCall(calling.function, text)]
    if calling.choice == "required":
        calls = _json_calls(text, "parameters")
        return (None, calls) if calls else (text, [])
    if calling.parser == "llama3_json":
        body = text.strip().removeprefix(_PYTHON_TAG)
        calls = _json_calls(body, "parameters") if body.startswith("{") else None
        return (None, calls) if calls else (text, [])
    at = text.find(_HERMES_OPEN)
    if at < 0:
        return text, []
    calls = []
    for block in _HERMES_CALL.findall(text[at:]):
        found = _json_calls(block.strip(), "arguments")
        if not found:
            return text, []  # not a well-formed call: the text, as the model wrote it
        calls += found
    return text[:at] or None, calls


def finish_reason(calling: ToolCalling, called: bool, generated: str) -> str:
    """The choice's finish reason, given the generation's and whether calls were made."""
    if generated == "length" or not called or calling.choice == "none":
        return generated
    return "stop" if calling.choice == "function" else "tool_calls"


def _content_end(calling: ToolCalling, text: str) -> int:
    """Where the content ends in a text holding calls (the first call's start)."""
    return max(0, text.find(_HERMES_OPEN)) if calling.choice == "auto" and calling.parser == "hermes" else 0


class ToolCallStream:
    """One streamed choice's deltas: content as it comes unless it may be the start of a call,
    then the calls (``feed`` per text piece, ``finish`` once, with the generation's finish reason)."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.in_call = calling.choice == "required"  # the rest is held until it can be parsed
        self.opened = False  # a named function's call was announced
        self.call_id = new_call_id()

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        if not piece or self.in_call:
            return []
        if self.calling.choice == "none":
            return self._content(len(self.text))
        if self.calling.choice == "function":  # the arguments, as they are generated
            delta: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
            if not self.opened:
                self.opened = True
                delta = {"index": 0, "id": self.call_id, "type": "function",
                         "function": {"name": self.calling.function, "arguments": piece}}
            return [{"tool_calls": [delta]}]
        if self.calling.parser == "llama3_json":
            start = self.text.lstrip()
            if start.startswith("{") or start.startswith(_PYTHON_TAG):
                self.in_call = True
                return []
            if not start or _PYTHON_TAG.startswith(start):
                return []  # maybe the tag: held until it is known
            return self._content(len(self.text))
        at = self.text.find(_HERMES_OPEN, self.sent)
        if at >= 0:
            self.in_call = True
            return self._content(at)
        # hold back a tail that may be the start of "<tool_call>"
        hold = next((n for n in range(min(len(_HERMES_OPEN) - 1, len(self.text)), 0, -1)
                     if _HERMES_OPEN.startswith(self.text[-n:])), 0)
        return self._content(len(self.text) - hold)

    def _content(self, end: int) -> list[dict[str, Any]]:
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return [{"content": piece}] if piece else []

    def finish(self, generated: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the choice's finish reason."""
        if self.calling.choice == "function":
            return [], finish_reason(self.calling, True, generated)
        _content, calls = split_calls(self.calling, self.text) if generated != "length" else (None, [])
        if not calls:
            return self._content(len(self.text)), generated
        deltas = self._content(_content_end(self.calling, self.text))
        deltas += [{"tool_calls": [call.openai(index)]} for index, call in enumerate(calls)]
        return deltas, finish_reason(self.calling, True, generated)


def message(calling: ToolCalling | None, text: str, generated: str) -> tuple[dict[str, Any], str]:
    """A non-streamed choice's assistant message and finish reason (a named function's call even
    when cut by ``length``, as its stream already sent it)."""
    if calling is None or (generated == "length" and calling.choice != "function"):
        return {"role": "assistant", "content": text}, generated
    content, calls = split_calls(calling, text)
    body: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        body["tool_calls"] = [call.openai() for call in calls]
    return body, finish_reason(calling, bool(calls), generated)
