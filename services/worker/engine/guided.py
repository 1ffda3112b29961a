"""Guided sequences on the driver: one llguidance matcher per sequence with a guide.

The driver holds the grammar's state, as vLLM V1's scheduler does: before a step it computes a
guided row's mask of allowed next tokens (one bit per token id, ``RowSampling.allowed``), the
sampling rank of any layout applies it, and after the step the matcher consumes the sampled
token. Once the grammar is complete the sequence ends. A continuation (``first_step`` > 0, the
request resumed on another group) replays the tokens already generated, the end of its prompt,
so the output still follows the grammar.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from services.common.guided import grammar_of
from services.common.sampling import InvalidRequest

# fresh matchers kept per guide, each copied for a new sequence: compiling a JSON schema's
# matcher took 0.48 ms here, copying one 1 us (a step of 16 guided rows computes its masks in ~0.5 ms)
PRISTINE_MATCHERS = 64


class Guides:
    """The model's llguidance tokenizer (made on first use: ~0.2 s) and new matchers."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll: Any = None  # llguidance.LLTokenizer
        self._executor: Any = None  # llguidance.LLExecutor
        self._pristine: OrderedDict[tuple[str, str], Any] = OrderedDict()  # guide -> a matcher at its start

    def matcher(self, guide: tuple[str, str], generated: Sequence[int]) -> Any:
        """An llguidance matcher for ``guide`` that has consumed ``generated``; InvalidRequest if
        the guide does not compile or those tokens break it."""
        # deferred: llguidance only once a guide is used (the GPU image serves the rest without it)
        import llguidance

        if self._tokenizer is None:
            raise InvalidRequest("structured outputs need the model's tokenizer.json")
        if self._ll is None:
            self._ll = llguidance.LLTokenizer(self._tokenizer.to_str(), n_vocab=self._vocab_size,
                                              eos_token=self._eos or None)
        pristine = self._pristine.get(guide)
        if pristine is None:
            pristine = llguidance.LLMatcher(self._ll, grammar_of(*guide), log_level=0)
            self._pristine[guide] = pristine
            if len(self._pristine) > PRISTINE_MATCHERS:
                self._pristine.popitem(last=False)
        else:
            self._pristine.move_to_end(guide)
        matcher = pristine.deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise InvalidRequest(f"the tokens already generated do not follow the guide: {matcher.get_error()}")
        if matcher.is_error():
            raise InvalidRequest(f"the guide does not compile: {matcher.get_error()}")
        return matcher

    def masks(self, matchers: list[Any]) -> list[bytes]:
        """Each matcher's mask of allowed next tokens (one bit per token id, LSB first), computed
        together on llguidance's threads without the GIL."""
        # deferred: as in matcher(), which made these matchers
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))
        out = np.zeros((len(matchers), (self._vocab_size + 31) // 32), dtype=np.int32)
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], out)
        return [row.tobytes() for row in out]
