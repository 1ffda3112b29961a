"""Structured outputs: a grammar a request's generated text must follow, as llguidance compiles it.

A guide is ``(kind, spec)``: ``json_schema`` (a JSON schema, as JSON text; ``{"type": "object"}``
is OpenAI's ``json_object``), ``regex`` (the whole output matches it) or ``choice`` (a JSON list of
strings, the output is one of them). The router checks a guide when it parses the request (a bad
one is a 400 before any stream), the worker compiles it against the model's tokenizer
(``services.worker.engine.guided``). llguidance rather than xgrammar (vLLM offers both): a 3 MB
wheel with no dependencies, where xgrammar's declare torch, transformers and triton (GPU kernels,
hundreds of MB on every CPU install). Measured here (``bench.grammar_engines``, SmolLM2's
tokenizer): a nested schema starts (compile, matcher, first mask) in 0.6-0.8 ms against
xgrammar's 6-7 ms, a request's wait before its first guided token; per token, mask and advance
take 5-19 µs at the median against xgrammar's 5-13 µs, both far below a decode step.
"""

from __future__ import annotations

import json
from functools import lru_cache

from services.common.errors import InvalidArgument

MAX_GUIDE_CHARS = 256 * 1024


class InvalidGuide(InvalidArgument):
    """A guide that does not compile; the message says why (HTTP 400)."""


@lru_cache(maxsize=256)
def grammar_of(kind: str, spec: str) -> str:
    """The llguidance grammar of a guide, checked (compiled grammars are cached by guide).
    ``kind`` is one of ``services.common.sampling.GUIDE_KINDS``: SamplingParams checks it, the
    router maps each field to one."""
    if not isinstance(spec, str) or not spec or len(spec) > MAX_GUIDE_CHARS:
        raise InvalidGuide(f"a {kind} guide must be non-empty text of at most {MAX_GUIDE_CHARS} characters")
    if kind == "choice":
        try:
            options = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidGuide(f"choice: not JSON ({exc})") from None
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidGuide("choice must be a non-empty list of non-empty strings")
    # deferred: llguidance only once a guide is used (a worker image without it serves the rest)
    import llguidance

    try:
        if kind == "json_schema":  # compact JSON unless the schema's "x-guidance" says otherwise: a model
            # cannot then spend its max_tokens on whitespace between the fields
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        else:
            grammar = llguidance.grammar_from(kind, spec)
    except ValueError as exc:
        raise InvalidGuide(f"{kind}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidGuide(f"{kind}: {error.strip()}"[:2000])
    return grammar
