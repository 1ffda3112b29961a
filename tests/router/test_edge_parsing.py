"""The HTTP edge's body reading and JSON parsing on their own (edge.py): chunk boundaries
anywhere, the windowed string scanner equal to the C parser, the errors it names."""

from __future__ import annotations

import json
import random

import pytest

from services.common.errors import PayloadTooLarge
from services.router import edge
from services.router.openai_format import BadRequest

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

ALPHABET = ["a", " ", "é", "€", "😀", '"', "\\", "\n", "\t", "\x01", "\u2028", "\ud800", "\udc00", "/", ":", ","]


def read(raw: bytes, cut: list[int], max_bytes: int = 2**20) -> edge.BodyReader:
    reader = edge.BodyReader(max_bytes)
    bounds = [0, *sorted(cut), len(raw)]
    for a, b in zip(bounds, bounds[1:]):
        reader.feed(raw[a:b])
    return reader


def random_value(rnd: random.Random, depth: int = 0):
    kind = rnd.randrange(6 if depth < 3 else 3)
    if kind == 0:
        return "".join(rnd.choice(ALPHABET) for _ in range(rnd.randrange(30)))
    if kind == 1:
        return rnd.choice([0, -7, 2.5, 1e300, True, False, None])
    if kind == 2:
        return "x" * rnd.randrange(3)
    if kind == 3:
        return [random_value(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    return {random_value(rnd, 3) if rnd.random() < 0.8 else "k": random_value(rnd, depth + 1)
            for _ in range(rnd.randrange(4))}


@pytest.mark.parametrize("window", [1, 3, 7, edge.STRING_WINDOW])
def test_the_windowed_parse_equals_json_loads_with_chunks_cut_anywhere(monkeypatch, window):
    monkeypatch.setattr(edge, "STRING_WINDOW", window)
    rnd = random.Random(window)
    for _ in range(300):
        value = {"prompt": random_value(rnd), "rest": random_value(rnd)}
        for ensure_ascii in (True, False):
            text = json.dumps(value, ensure_ascii=ensure_ascii)
            raw = text.encode("utf-8", "surrogatepass")
            expected = json.loads(text)
            if any("\ud800" <= c <= "\udfff" for c in text) and not ensure_ascii:
                # a lone surrogate written raw is not UTF-8: a 400 naming the byte
                with pytest.raises(BadRequest, match="not valid UTF-8"):
                    read(raw, [rnd.randrange(len(raw) + 1)]).text()
                continue
            reader = read(raw, [rnd.randrange(len(raw) + 1) for _ in range(rnd.randrange(4))])
            assert reader.size == len(raw) and reader.separators == raw.count(b",") + raw.count(b":")
            assert reader.surrogate_escape == (edge._SURROGATE_ESCAPE.search(raw) is not None)
            for pure_python in (False, True):
                try:
                    got = edge.parse_json_object(reader.text(), surrogate_escape=reader.surrogate_escape,
                                                 pure_python=pure_python)
                except BadRequest as exc:  # only a lone surrogate, named by its field
                    assert "lone UTF-16 surrogate" in str(exc), exc
                    continue
                assert got == expected


def test_a_surrogate_escape_split_across_chunks_is_seen():
    raw = b'{"prompt": "ab\\ud800cd"}'
    at = raw.index(b"\\u")
    for cut in range(at, at + 5):
        reader = read(raw, [cut])
        assert reader.surrogate_escape
        with pytest.raises(BadRequest, match="lone UTF-16 surrogate") as info:
            reader.parse()
        assert info.value.param == "prompt"


def test_a_character_split_across_chunks_decodes_and_bad_utf8_names_its_byte():
    raw = '{"prompt": "€😀"}'.encode()
    for cut in range(len(raw) + 1):
        assert read(raw, [cut]).parse() == {"prompt": "€😀"}
    bad = b'{"prompt": "ab\xff"}'
    with pytest.raises(BadRequest, match=r"not valid UTF-8: invalid start byte at byte 14"):
        read(bad, [5]).text()
    with pytest.raises(BadRequest, match="at the end of the body"):
        read('{"p": "€'.encode()[:-1], []).text()


def test_past_the_limit_is_413_at_the_chunk_that_crosses_it():
    reader = edge.BodyReader(10)
    reader.feed(b"12345")
    with pytest.raises(PayloadTooLarge, match="12 bytes or more; this server takes at most 10"):
        reader.feed(b"1234567")


def test_large_or_many_valued_bodies_are_parsed_off_the_loop():
    small = edge.BodyReader(2**24)
    small.feed(json.dumps({"prompt": "ab " * 1000}).encode())
    assert small.parse_inline
    long_prompt = edge.BodyReader(2**24)
    long_prompt.feed(json.dumps({"prompt": "ab " * 200_000}).encode())
    assert not long_prompt.parse_inline and long_prompt.parse() == {"prompt": "ab " * 200_000}
    many = edge.BodyReader(2**24)
    many.feed(json.dumps({"prompt": list(range(30_000))}).encode())
    assert not many.parse_inline and many.parse()["prompt"][-1] == 29_999


@pytest.mark.parametrize(("text", "message"), [
    ('{"a": "x', "Unterminated string starting at"),
    ('{"a": "\\x"}', "Invalid \\escape"),
    ('{"a": "\\u12"}', "Invalid \\uXXXX escape"),
    ('{"a": "a\x01"}', "Invalid control character"),
    ('{"a": NaN}', "NaN is not valid JSON"),
    ("[1]", "must be a JSON object, got list"),
])
def test_the_windowed_parse_names_the_same_errors(text, message):
    for pure_python in (False, True):
        with pytest.raises(BadRequest, match="the body is not valid JSON|must be a JSON object") as info:
            edge.parse_json_object(text, pure_python=pure_python)
        assert message in str(info.value)
