"""The shared detokenizer gives exactly the two-window scheme's deltas (fast path or not)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from services.common.detokenizer import REPLACEMENT, Detokenizer, TokenTexts

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

TEXTS = ["Hello, world! The café serves crème brûlée.", "日本語のテキスト、そして絵文字 🎉🚀👍🏽 and more",
         "  leading spaces\tand\ttabs\n\nnew lines", "ﬁ ligature, Ω, ∑, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
         "a b c 1 2 3 ..."]


class IncrementalDetokenizer:
    """The two-window scheme on every token, with no fast path: the reference the deltas must equal."""

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


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    model_dir = request.getfixturevalue("tiny_model_dir" if request.param == "tiny" else "smollm2_dir")
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def streams(tokenizer: Tokenizer, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = tokenizer.get_vocab_size()
    specials = sorted(tokenizer.get_added_tokens_decoder())
    out = [tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS]
    for _ in range(40):  # encoded text, random ids (partial UTF-8 included) and special tokens, mixed
        ids: list[int] = []
        for _ in range(rng.randrange(1, 60)):
            kind = rng.random()
            if kind < 0.5:
                ids += tokenizer.encode(rng.choice(TEXTS)[rng.randrange(8):rng.randrange(9, 40)],
                                        add_special_tokens=False).ids
            elif kind < 0.9:
                ids.append(rng.randrange(vocab))
            elif specials:
                ids.append(rng.choice(specials))
        out.append(ids)
    return out


@pytest.mark.parametrize("stop", [(), (" the", "é"), ("🎉", "\n\n", "xyz")])
def test_deltas_equal_the_two_window_scheme(tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
    texts = TokenTexts(tokenizer)
    assert texts.enabled  # both models are byte-level BPE: the fast path is what is tested
    fast_tokens = 0
    for ids in streams(tokenizer, seed=len(stop)):
        ours, reference = Detokenizer(tokenizer, stop, texts=texts), IncrementalDetokenizer(tokenizer, stop)
        for token_id in ids:
            fast_tokens += texts.get(token_id) is not None
            assert ours.push(token_id) == reference.push(token_id), (ids, token_id)
            assert ours.text == reference.text
    assert fast_tokens > 100


def test_a_tokenizer_without_a_byte_level_decoder_always_takes_the_two_window_path(tokenizer: Tokenizer) -> None:
    from tokenizers import decoders

    other = Tokenizer.from_str(tokenizer.to_str())
    other.decoder = decoders.Metaspace()
    texts = TokenTexts(other)
    assert not texts.enabled
    ids = streams(other, seed=7)[0]
    ours, reference = Detokenizer(other, texts=texts), IncrementalDetokenizer(other)
    assert [ours.push(t) for t in ids] == [reference.push(t) for t in ids]
    assert all(texts.get(t) is None for t in ids)
