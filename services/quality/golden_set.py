"""The golden set: a fixed English text, cut into token chunks, on which two shard plans are scored.

The text is the prose of CPython's own reference documentation (``pydoc_data.topics``, the pages
``help("assert")`` prints), which every Python installation has, so no model hub and no download
is needed. Grammar productions and code examples (the indented blocks) are left out and each
paragraph is joined into one line, which leaves ordinary English with some Python words in it.

The text depends on the Python version that ships it, so it carries a fingerprint (the SHA-256 of
the text): two scores are comparable only when their fingerprints agree. Within one run both
plans are scored on the same chunks.

Chunks are consecutive windows of ``chunk_tokens`` ids of the tokenized text; each is scored as an
independent prompt, so ``chunk_tokens - 1`` positions of each count.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from pydoc_data import topics as pydoc_topics

DEFAULT_CHUNK_TOKENS = 512
DEFAULT_CHUNKS = 32  # 32 x 511 = 16,352 scored positions
# a paragraph counts as prose when at least this share of its characters are letters or spaces
MIN_PROSE_SHARE = 0.85


def _is_prose(paragraph: str) -> bool:
    if not paragraph or paragraph[0].isspace():  # indented: a grammar rule or a code example
        return False
    first = paragraph.splitlines()[0]
    if set(first) <= set("*=-~^ "):  # a heading's underline
        return False
    letters = sum(ch.isalpha() or ch == " " for ch in paragraph)
    return letters >= MIN_PROSE_SHARE * len(paragraph) and len(paragraph) >= 80


def _prose(pages: Iterable[str]) -> str:
    """The prose paragraphs of ``pages``, in order, each joined into one line."""
    return "\n".join(" ".join(line.strip() for line in block.splitlines())
                     for page in pages for block in page.split("\n\n") if _is_prose(block))


def golden_text() -> str:
    """The prose of every topic, in the order of their names, one paragraph a line."""
    return _prose(pydoc_topics.topics[name] for name in sorted(pydoc_topics.topics))


def _stdlib_docstrings() -> Iterator[str]:
    """The module, class and function docstrings of the standard library's top-level modules,
    read from their source (nothing is imported), in file order."""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):  # the module first
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield ast.get_docstring(node) or ""


@functools.cache  # one text per Python installation: its 360 modules parsed once a process (1.7 CPU-s)
def calibration_text() -> str:
    """Text to calibrate quantization on, never the golden set's: the prose of the docstrings of
    the standard library's own modules, one paragraph a line. Also English with Python words in
    it, but other pages by other authors (the golden text is the language reference), so a gate
    on the golden set measures what the calibration did not see."""
    return _prose(_stdlib_docstrings())


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class GoldenSet:
    """Token chunks of the golden text under one tokenizer."""

    chunks: tuple[tuple[int, ...], ...]
    text_fingerprint: str
    chunk_tokens: int

    @property
    def scored_tokens(self) -> int:
        return sum(len(chunk) - 1 for chunk in self.chunks)

    @classmethod
    def build(cls, encode: Callable[[str], Sequence[int]], *, chunks: int = DEFAULT_CHUNKS,
              chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> GoldenSet:
        """``chunks`` consecutive windows of ``chunk_tokens`` ids of ``encode(golden_text())``;
        fails when the text is shorter than asked."""
        if chunks < 1 or chunk_tokens < 2:
            raise ValueError(f"need chunks >= 1 and chunk_tokens >= 2, got {chunks} and {chunk_tokens}")
        text = golden_text()
        ids = list(encode(text))
        if len(ids) < chunks * chunk_tokens:
            raise ValueError(f"the golden text has {len(ids)} tokens; {chunks} chunks of {chunk_tokens} need "
                             f"{chunks * chunk_tokens}")
        windows = tuple(tuple(ids[i * chunk_tokens:(i + 1) * chunk_tokens]) for i in range(chunks))
        return cls(chunks=windows, text_fingerprint=fingerprint(text), chunk_tokens=chunk_tokens)
