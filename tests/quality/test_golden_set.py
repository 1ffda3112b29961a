"""The golden set: ordinary English from the interpreter's own documentation, cut the same way
every time, long enough for 16,000 scored positions under SmolLM2's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.quality.golden_set import DEFAULT_CHUNKS, GoldenSet, fingerprint, golden_text

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority


def test_the_text_is_prose_and_deterministic() -> None:
    text = golden_text()
    assert text == golden_text() and len(text) > 100_000
    lines = text.splitlines()
    assert all(not line[0].isspace() for line in lines)  # no code blocks or grammar rules
    letters = sum(ch.isalpha() or ch == " " for ch in text)
    assert letters / len(text) > 0.9
    assert "assert" in text and "the" in text.split()


def test_chunks_are_consecutive_windows(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    golden = GoldenSet.build(encode, chunks=3, chunk_tokens=50)
    ids = encode(golden_text())
    assert [list(c) for c in golden.chunks] == [ids[0:50], ids[50:100], ids[100:150]]
    assert golden.scored_tokens == 147 and golden.text_fingerprint == fingerprint(golden_text())
    assert GoldenSet.build(encode, chunks=3, chunk_tokens=50) == golden
    with pytest.raises(ValueError, match="golden text has"):
        GoldenSet.build(encode, chunks=10_000, chunk_tokens=512)


def test_default_set_has_16k_scored_positions_under_smollm2(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    golden = GoldenSet.build(lambda text: tokenizer.encode(text, add_special_tokens=False).ids)
    assert len(golden.chunks) == DEFAULT_CHUNKS and golden.scored_tokens >= 16_000
