"""The HTTP front door's first look at a request body: media type, size, JSON, Unicode.

Everything here runs before the request is parsed into a generation, so a malformed body is a
400/413/415 with OpenAI's error body and never reaches admission (or a 500 from deep inside
json, the tokenizer or the response encoder). No web framework here (``http_api.py`` reads the
bytes and calls these).

Cost on the event loop, which relays every other stream's tokens: no step over a large body
runs there in one piece. :class:`BodyReader` takes the body a chunk at a time as it arrives,
decoding UTF-8 incrementally, counting the separators and looking for a surrogate escape, so
each chunk costs a fraction of a millisecond. A small body (few bytes, few values) is then
parsed on the loop by the C scanner. A large one is parsed on the router's executor by the
pure-Python scanner, whose strings are read in windows of :data:`STRING_WINDOW` characters
(:func:`scan_string`): the C parser holds the GIL for a whole value (an 8 MiB array of small
ints: ~70 ms; a 4 MiB string: ~3 ms here, far more on a slow, busy core), the windowed one lets
the loop take it back at every switch interval.
"""

from __future__ import annotations

import codecs
import functools
import json
import json.scanner
import re
from typing import Any

from services.common.errors import PayloadTooLarge, UnsupportedMediaType
from services.router.openai_format import BadRequest as BadBody

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# Bodies up to this size, with at most this many separators, are parsed on the loop in C.
INLINE_PARSE_MAX_BYTES = 256 * 1024
INLINE_PARSE_MAX_SEPARATORS = 20_000
# The characters of a JSON string the pure-Python parse reads in one regex call.
STRING_WINDOW = 64 * 1024
_STRING_SPECIAL = re.compile(r'["\\\x00-\x1f]')
_CONTROL_CHAR = re.compile(r"[\x00-\x1f]")
_CONTROL_BYTES = bytes(range(0x20))
_STRING_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
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


class BodyReader:
    """A request body taken a chunk at a time (see the module docstring): its size, its text, how
    many JSON separators it has, whether it spells a surrogate escape and whether it holds a
    control character, each worked out as the chunks arrive. ``feed`` raises PayloadTooLarge once
    past ``max_bytes`` (the caller keeps reading and dropping, up to a bound, so that a client still
    sending reads the 413); ``text``
    raises BadBody on invalid UTF-8, naming the byte offset in the whole body (the body is read to
    its end first, as for any other 400)."""

    # the longest run of bytes a surrogate escape spans (``\uD8``): kept from one chunk to the next
    _CARRY = 4

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self.separators = 0
        self.surrogate_escape = False
        self.control_chars = False
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._texts: list[str] = []
        self._tail = b""
        self._error: str | None = None

    def feed(self, chunk: bytes) -> None:
        offset = self.size
        self.size += len(chunk)
        if self.size > self.max_bytes:
            self._texts.clear()
            raise too_large(self.size, self.max_bytes)
        if self._error is not None:
            return
        try:
            self._texts.append(self._decoder.decode(chunk))
        except UnicodeDecodeError as exc:
            self._error = f"{exc.reason} at byte {offset + exc.start}"
            self._texts.clear()
            return
        self.separators += chunk.count(b",") + chunk.count(b":")
        if not self.control_chars:  # tab and newline too: they are whitespace between values, not in strings
            self.control_chars = len(chunk.translate(None, _CONTROL_BYTES)) != len(chunk)
        if not self.surrogate_escape:
            self.surrogate_escape = _SURROGATE_ESCAPE.search(self._tail + chunk[:16]) is not None or \
                _SURROGATE_ESCAPE.search(chunk) is not None
            self._tail = chunk[-self._CARRY:]

    def text(self) -> str:
        """The whole body as text (after the last chunk)."""
        if self._error is None:
            try:
                self._texts.append(self._decoder.decode(b"", final=True))
            except UnicodeDecodeError as exc:
                self._error = f"{exc.reason} at the end of the body"
        if self._error is not None:
            raise BadBody(f"the body is not valid UTF-8: {self._error}")
        return "".join(self._texts)

    @property
    def parse_inline(self) -> bool:
        """Whether the body is cheap enough to parse on the event loop (see the module docstring)."""
        return self.size <= INLINE_PARSE_MAX_BYTES and self.separators <= INLINE_PARSE_MAX_SEPARATORS

    def parse(self) -> dict[str, Any]:
        """The body as a JSON object (after the last chunk): by the C scanner when
        :attr:`parse_inline`, else by the pure-Python one, for a caller off the event loop."""
        return parse_json_object(self.text(), surrogate_escape=self.surrogate_escape,
                                 control_chars=self.control_chars, pure_python=not self.parse_inline)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _hex4(s: str, at: int) -> int:
    digits = s[at:at + 4]
    if len(digits) == 4 and all(c in "0123456789abcdefABCDEF" for c in digits):
        return int(digits, 16)
    raise json.JSONDecodeError("Invalid \\uXXXX escape", s, at - 1)


def scan_string(s: str, end: int, strict: bool = True, *, control_chars: bool = True) -> tuple[str, int]:
    """``json.decoder.scanstring``'s contract (the string whose opening quote is at ``end - 1``,
    and the index after its closing quote), reading at most :data:`STRING_WINDOW` characters per
    call into C, so that a thread parsing a many-megabyte string lets go of the GIL between them.
    A string without escapes is one slice of ``s``; ``control_chars`` False: the body has no
    control character at all, so none needs looking for."""
    pos, n = end, len(s)
    while True:  # the closing quote, as long as no backslash comes first
        stop = min(pos + STRING_WINDOW, n)
        quote = s.find('"', pos, stop)
        if s.find("\\", pos, stop if quote < 0 else quote) >= 0:
            return _scan_escaped(s, end, strict)
        if quote >= 0:
            if strict and control_chars and _CONTROL_CHAR.search(s, end, quote):
                return _scan_escaped(s, end, strict)  # which names the character
            return s[end:quote], quote + 1
        if stop == n:
            raise json.JSONDecodeError("Unterminated string starting at", s, end - 1)
        pos = stop


def _scan_escaped(s: str, end: int, strict: bool) -> tuple[str, int]:
    """:func:`scan_string` for a string with escapes (or control characters): its pieces
    between them, a window at a time."""
    chunks: list[str] = []
    pos, n = end, len(s)
    while True:
        found = _STRING_SPECIAL.search(s, pos, min(pos + STRING_WINDOW, n))
        if found is None:
            if pos + STRING_WINDOW >= n:
                raise json.JSONDecodeError("Unterminated string starting at", s, end - 1)
            chunks.append(s[pos:pos + STRING_WINDOW])
            pos += STRING_WINDOW
            continue
        at = found.start()
        if at > pos:
            chunks.append(s[pos:at])
        char = s[at]
        if char == '"':
            return "".join(chunks), at + 1
        if char != "\\":
            if strict:
                raise json.JSONDecodeError(f"Invalid control character {char!r} at", s, at)
            chunks.append(char)
            pos = at + 1
            continue
        escape = s[at + 1:at + 2]
        if escape != "u":
            if escape not in _STRING_ESCAPES:
                raise json.JSONDecodeError(f"Invalid \\escape: {escape!r}", s, at)
            chunks.append(_STRING_ESCAPES[escape])
            pos = at + 2
            continue
        code, pos = _hex4(s, at + 2), at + 6
        if 0xD800 <= code <= 0xDBFF and s[pos:pos + 2] == "\\u":  # a surrogate pair is one character
            low = _hex4(s, pos + 2)
            if 0xDC00 <= low <= 0xDFFF:
                code, pos = 0x10000 + ((code - 0xD800) << 10 | (low - 0xDC00)), pos + 6
        chunks.append(chr(code))


def parse_json_object(text: str, *, surrogate_escape: bool = True, control_chars: bool = True,
                      pure_python: bool = False) -> dict[str, Any]:
    """The body's text as a JSON object, with every string valid Unicode; raises BadBody (400).
    ``surrogate_escape`` False: the body spells no ``\\uD800``-``\\uDFFF`` escape (the only way
    JSON writes a lone surrogate), so the strings need no second look. ``pure_python``: the
    windowed parse, for a thread off the event loop (see the module docstring); ``control_chars``
    False tells it the text has none (U+0000-U+001F: raw, they are invalid in a string)."""
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    if pure_python:
        decoder.parse_string = functools.partial(scan_string, control_chars=control_chars)
        decoder.scan_once = json.scanner.py_make_scanner(decoder)
    try:
        body = decoder.decode(text)
    except RecursionError:
        raise BadBody("the body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, an integer beyond Python's digit limit
        raise BadBody(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadBody(f"the body must be a JSON object, got {type(body).__name__}")
    if surrogate_escape:
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
