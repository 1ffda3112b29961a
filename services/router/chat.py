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
        out.append(ChatMessage(role, content))
    return out


def render_chat(template: str, messages: list[ChatMessage], *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True) -> str:
    try:
        return _compile(template).render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as exc:
        raise InvalidArgument(f"the chat template rejected the messages: {exc}") from exc
