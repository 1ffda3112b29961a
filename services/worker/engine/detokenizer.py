"""Incremental detokenization: text deltas that never split a multi-byte character.

Decoding token by token breaks characters whose UTF-8 bytes span several byte-level tokens. As
vLLM does, decode a small window twice — the tokens already shown and the tokens including the
new one — and emit the difference only when it does not end in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (new text, whether a stop string ended the text)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return "", False
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._append(delta)

    def _append(self, delta: str) -> tuple[str, bool]:
        if self.stop:
            start = max(0, len(self.text) - max(len(s) for s in self.stop) + 1)
            candidate = self.text + delta
            hits = [i for i in (candidate.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                delta = candidate[len(self.text):cut] if cut >= len(self.text) else ""
                self.text = candidate[:cut]
                return delta, True
        self.text += delta
        return delta, False
