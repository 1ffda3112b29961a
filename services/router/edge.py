"""The HTTP front door's first look at a request body: media type, size, JSON, Unicode.

Everything here runs before the request is parsed into a generation, so a malformed body is a
400/413/415 with OpenAI's error body and never reaches admission (or a 500 from deep inside
json, the tokenizer or the response encoder). No web framework here (``http_api.py`` reads the
bytes and calls these).

Cost on the event loop: ``json.loads`` is C and holds the GIL for the whole parse, which takes
time in proportion to the number of values (an 8 MiB array of small ints: ~70 ms). A body with
few values (a long prompt is one string) parses in a millisecond or two, so only bodies that
may hold many values (counted by their commas and colons, an upper bound) are parsed by the
pure-Python scanner on the router's executor, which yields the GIL every switch interval.
"""

from __future__ import annotations

import json
import json.scanner
import re
from typing import Any

from services.common.errors import PayloadTooLarge, UnsupportedMediaType
from services.router.openai_format import BadRequest as BadBody

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# Bodies with more separators than this may hold enough values to stall the loop in C.
INLINE_PARSE_MAX_SEPARATORS = 20_000
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_content_type(content_type: str | None) -> None:
    """JSON endpoints read ``application/json`` (parameters allowed); a missing Content-Type is
    taken as JSON, as curl and many clients send none."""
    if content_type is None or not content_type.strip():
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {content_type[:100]!r}")


def check_declared_length(content_length: str | None, max_bytes: int) -> None:
    if content_length is None:
        return
    try:
        declared = int(content_length)
    except ValueError:
        raise BadBody(f"Content-Length must be an integer, got {content_length[:40]!r}") from None
    if declared > max_bytes:
        raise too_large(declared, max_bytes)


def too_large(size: int, max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is {size} bytes or more; this server takes at most {max_bytes} "
                           f"bytes (--max-body-bytes)")


def parse_inline(raw: bytes) -> bool:
    """Whether ``raw`` is cheap enough to parse on the event loop (see the module docstring)."""
    return raw.count(b",") + raw.count(b":") <= INLINE_PARSE_MAX_SEPARATORS


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes, *, pure_python: bool = False) -> dict[str, Any]:
    """The body as a JSON object, with every string valid Unicode; raises BadBody (400)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadBody(f"the body is not valid UTF-8: {exc}") from None
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    if pure_python:
        decoder.scan_once = json.scanner.py_make_scanner(decoder)
    try:
        body = decoder.decode(text)
    except RecursionError:
        raise BadBody("the body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, an integer beyond Python's digit limit
        raise BadBody(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadBody(f"the body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(raw):  # the only way JSON spells a lone surrogate
        check_unicode(body)
    return body


def check_unicode(body: dict[str, Any]) -> None:
    """Reject a lone UTF-16 surrogate in any string (keys too): the tokenizer cannot take it and
    UTF-8 cannot encode it, so no answer could echo it. The error names the field."""
    for key in body:
        if _LONE_SURROGATE.search(key):
            raise BadBody("the body has a key with a lone UTF-16 surrogate: strings must be valid Unicode")
    stack: list[tuple[str, Any]] = list(body.items())
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _LONE_SURROGATE.search(value)
            if found:
                param = re.split(r"[.\[]", path, maxsplit=1)[0]
                raise BadBody(f"{path} contains a lone UTF-16 surrogate (U+{ord(found.group()):04X} at "
                              f"index {found.start()}): strings must be valid Unicode",
                              param if _LONE_SURROGATE.search(param) is None else None)
        elif isinstance(value, dict):
            for k, v in value.items():
                if _LONE_SURROGATE.search(k):
                    raise BadBody(f"{path} has a key with a lone UTF-16 surrogate: strings must be valid Unicode",
                                  re.split(r"[.\[]", path, maxsplit=1)[0])
                stack.append((f"{path}.{k}", v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
