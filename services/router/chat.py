"""Chat templates: render OpenAI-style messages into a prompt, as transformers does.

``transformers.PreTrainedTokenizerBase.apply_chat_template`` compiles the template from
``tokenizer_config.json`` in a sandboxed Jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter and the
``raise_exception`` / ``strftime_now`` globals, and passes the special tokens as variables. We
do the same, so the same messages give the same prompt text (and, tokenized without adding
special tokens, the same ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidArgument

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()  # an assistant's calls: {id, type, function: {name, arguments}}
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: a call's arguments as an object where they are
        JSON (templates write them with ``tojson``), as transformers' and vLLM's callers pass them."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{**call, "function": {**call["function"],
                                                       "arguments": _arguments(call["function"]["arguments"])}}
                                 for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _tool_calls(i: int, raw: Any) -> tuple[dict[str, Any], ...]:
    """An assistant message's ``tool_calls``, checked."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidArgument(f"messages[{i}].tool_calls must be a list")
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments"), str):
            raise InvalidArgument(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                                  f"{{\"name\": ..., \"arguments\": JSON text}}}}")
        calls.append({"id": str(call.get("id", "")), "type": "function",
                      "function": {"name": function["name"], "arguments": function["arguments"]}})
    return tuple(calls)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def parse_messages(raw: Any) -> list[ChatMessage]:
    """OpenAI ``messages`` (content as a string or a list of ``{"type": "text"}`` parts) to
    :class:`ChatMessage`; InvalidArgument names the bad message."""
    if not isinstance(raw, list) or not raw:
        raise InvalidArgument("messages must be a non-empty list")
    out: list[ChatMessage] = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise InvalidArgument(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None:
            # OpenAI allows a null (or missing) content only on an assistant message (one that
            # made tool calls); a user's empty turn would silently generate from nothing
            if role != "assistant":
                raise InvalidArgument(f"messages[{i}].content must be a string or a list of text parts for "
                                      f"a {role} message, got {'null' if 'content' in message else 'nothing'}")
            content = ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidArgument(f"messages[{i}].content[{j}]: only text parts are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string or a list of text parts")
        calls = _tool_calls(i, message.get("tool_calls")) if role == "assistant" else ()
        call_id = message.get("tool_call_id")
        if role == "tool" and not isinstance(call_id, str):
            raise InvalidArgument(f"messages[{i}]: a tool message needs tool_call_id, the call it answers")
        name = message.get("name")
        out.append(ChatMessage(role, content, calls, call_id if role == "tool" else None,
                               name if isinstance(name, str) else None))
    return out


def render_chat(template: str, messages: list[ChatMessage], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text; ``tools`` (OpenAI's function tools, as sent) reach the template as its
    ``tools`` variable, None when the request has none (what templates test for)."""
    try:
        return _compile(template).render(
            messages=[m.for_template() for m in messages], tools=tools,
            add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as exc:
        raise InvalidArgument(f"the chat template rejected the messages: {exc}") from exc
