"""Incremental detokenization: text deltas that never split a multi-byte character, cheaply for
the common token. The worker's engine and the router both use it, so their texts agree.

Decoding token by token breaks characters whose UTF-8 bytes span several byte-level tokens. As
vLLM does, decode the window of tokens already shown and the window including the new one, and
emit the difference unless it ends in an incomplete character (U+FFFD): two decodes per token.

For a byte-level BPE tokenizer (the Llama-3 / SmolLM2 / GPT-2 family) most tokens do not need it:
the decoder maps each token to its bytes (a skipped special token to none) and decodes the
concatenation as UTF-8 with U+FFFD for invalid sequences, so when a token's bytes are valid
UTF-8 on their own (they then start at a character boundary), decoding ``window + token`` gives
``decode(window)`` followed by the token's own text, whatever the window ends with. So while no
token with bytes is held back (the last delta did not stop inside a character):

- a token with valid bytes: its delta is its own text, and the window offsets move exactly as the
  two-window decode would move them;
- a token without bytes (a skipped special token): no delta, offsets unchanged, as the two-window
  decode finds the same text twice.

A token's text is decoded once per token id (:class:`TokenTexts`); every other token (partial
UTF-8, anything after one until a delta is emitted, any token of a tokenizer with another
decoder) takes the two-window path.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders

REPLACEMENT = "\ufffd"


class TokenTexts:
    """Per token id of one tokenizer: its text when the fast path may use it ("" for a token
    without bytes), else None. Filled lazily (one decode the first time an id is seen)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.enabled = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._texts: dict[int, str | None] = {}

    def get(self, token_id: int) -> str | None:
        try:
            return self._texts[token_id]
        except KeyError:
            pass
        text: str | None = None
        if self.enabled:
            # "" only for a token without bytes (a skipped special token); U+FFFD anywhere means
            # the bytes are not valid UTF-8 on their own
            text = self.tokenizer.decode([token_id], skip_special_tokens=True)
            if REPLACEMENT in text:
                text = None
        self._texts[token_id] = text
        return text


class Detokenizer:
    """Text deltas of a token stream that never split a multi-byte character, with the request's
    stop strings applied (see the module docstring)."""

    __slots__ = ("tokenizer", "stop", "texts", "ids", "prefix_offset", "read_offset", "stopped_by", "_held",
                 "_prefix", "_pieces", "_max_stop")

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), *, texts: TokenTexts | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.texts = texts if texts is not None else TokenTexts(tokenizer)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.stopped_by: str | None = None  # the stop string that ended the text (the earliest found)
        self._held = False  # ids[read_offset:] may hold bytes of an unfinished character
        self._prefix: tuple[int, int, str] = (0, 0, "")  # the decoded prefix window, by its offsets
        self._pieces: list[str] = []  # the text so far, joined when asked (no O(n) copy per token)
        self._max_stop = max((len(s) for s in stop), default=0)

    @property
    def text(self) -> str:
        """The whole text so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (new text, whether a stop string ended the text)."""
        ids = self.ids
        ids.append(token_id)
        delta = None if self._held else self.texts.get(token_id)
        if delta is None:
            start, end, prefix = self._prefix
            if (start, end) != (self.prefix_offset, self.read_offset):  # else: unchanged while a character waits
                prefix = self._decode(ids[self.prefix_offset:self.read_offset])
                self._prefix = (self.prefix_offset, self.read_offset, prefix)
            full = self._decode(ids[self.prefix_offset:])
            if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
                self._held = True
                return "", False
            delta = full[len(prefix):]
            self._held = False
        elif not delta:
            return "", False  # no bytes: nothing to show, nothing held
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        if not self.stop:
            self._pieces.append(delta)
            return delta, False
        return self._append_checking_stops(delta)

    def _append_checking_stops(self, delta: str) -> tuple[str, bool]:
        text = self.text
        start = max(0, len(text) - self._max_stop + 1)
        candidate = text + delta
        hits = [(i, s) for s in self.stop if (i := candidate.find(s, start)) >= 0]
        if hits:
            cut, self.stopped_by = min(hits, key=lambda hit: hit[0])
            delta = candidate[len(text):cut] if cut >= len(text) else ""
            candidate = candidate[:cut]
        self._pieces = [candidate]
        return delta, bool(hits)
