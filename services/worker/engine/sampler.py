"""Token sampling from a batch of logits with per-row parameters.

For each row (one sequence's last position), in float32:

- ``temperature == 0``: greedy, ``argmax(logits)`` (first index on ties).
- otherwise ``z = logits / temperature``; top-k keeps the ``k`` largest ``z`` (0 = all); top-p
  (nucleus) then keeps the smallest prefix of the remaining tokens, sorted by probability, whose
  cumulative probability ``softmax(z)`` reaches ``top_p``; the token is drawn from the
  renormalised kept set. The draw is an exponential race, ``argmax(p_i / q_i)`` with
  ``q_i ~ Exp(1)``, which picks ``i`` with probability ``p_i``.

Before any of that, greedy rows included, a row's penalties are applied to its logits (repetition
over its prompt and generated tokens, then frequency and presence over the generated ones), its
``logit_bias`` is added and its ``banned`` tokens (what min_tokens keeps out) and the tokens its
guide does not allow (``allowed``, structured outputs) go to -inf;
``min_p`` then drops, after temperature, the tokens less likely than ``min_p`` times the most
likely one (before top-k and top-p, in vLLM's order).

Reproducibility: a row whose request has a ``seed`` draws its ``q`` from its own
``torch.Generator`` seeded with ``mix(seed, n)``, ``n`` being the number of tokens the request
has generated so far: ``first_step + i`` for the sequence's token ``i``, where ``first_step``
counts the tokens generated before its prompt's end (a continuation's prompt holds them). The
token drawn therefore depends only on the row's logits, its parameters, its seed and ``n``: the
same request gives the same tokens alone or in any batch, after a preemption (recompute), and
when continued from prompt + generated ids on another replica group. Rows without a seed share the sampler's generator.

Logprobs are *raw*: ``log_softmax`` of the unmodified logits, before temperature, top-k or top-p
(vLLM's default ``logprobs_mode="raw_logprobs"``). Each row gets the sampled token's logprob and,
when its request asks for ``logprobs = k > 0``, the ``k`` most likely tokens with theirs.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from services.common.sampling import SamplingParams
from services.modeling.kernels import greedy_logsumexp, mask_tokens_
from services.worker.engine.step import RowSampling

_MASK64 = 2**64 - 1


def mix_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, tokens generated so far): splitmix64 of
    ``seed + (step + 1) * golden``. Distinct steps of one seed give unrelated streams."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SampleResult:
    """Per row: the chosen token, its raw logprob, and ``[(token_id, logprob), ...]`` best
    first (empty when the row asked for no top logprobs). Iterating yields one
    ``(token_id, logprob, top_logprobs)`` tuple per row."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]

    def __iter__(self) -> Iterator[tuple[int, float, list[tuple[int, float]]]]:
        return iter(zip(self.token_ids, self.logprobs, self.top_logprobs, strict=True))

    def __len__(self) -> int:
        return len(self.token_ids)


class SamplerError(ValueError):
    """Logits and per-row parameters do not match."""


class Sampler:
    """Stateless apart from the generator used by rows without a seed."""

    def __init__(self, *, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, params: Seq[SamplingParams],
                 num_generated: Seq[int]) -> SampleResult:
        """``logits``: float32 ``[n, vocab]``; ``params[i]`` and ``num_generated[i]`` (tokens
        row i's sequence has generated so far, after ``params[i].first_step``) describe row i."""
        if len(params) != len(num_generated):
            raise SamplerError(f"got {len(params)} params but {len(num_generated)} num_generated")
        return self.sample(logits, [RowSampling.of(p, n) for p, n in zip(params, num_generated, strict=True)])

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: Seq[RowSampling]) -> SampleResult:
        """``logits``: ``[n, vocab]`` in any float dtype (computed on in float32); ``rows[i]``
        describes row i."""
        if logits.dim() != 2:
            raise SamplerError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
        n, vocab = logits.shape
        if len(rows) != n:
            raise SamplerError(f"logits have {n} rows but got {len(rows)} sampling rows")
        if n == 0:
            return SampleResult([], [], [])
        device = logits.device
        # raw logprob of token t = logit_t − logsumexp(logits): one reduction per row instead of
        # materialising log_softmax over the whole vocabulary every step; both reductions in one
        # kernel on CPU, straight from the model's dtype (exact in float32)
        token_ids, log_normalizer = greedy_logsumexp(logits)
        sampled_rows = [i for i, r in enumerate(rows) if r.temperature != 0]
        k_max = min(max(r.top_logprobs for r in rows), vocab)
        adjusted_rows = [i for i, r in enumerate(rows) if r.logit_bias or r.banned or r.presence_penalty
                         or r.frequency_penalty or r.repetition_penalty != 1 or r.allowed]
        raw = logits
        if sampled_rows or k_max > 0 or adjusted_rows:
            logits = logits.float()
        # what the token is chosen from: the logits with the rows' penalties, biases, bans and
        # guides applied, in place on a copy (the returned logprobs stay the raw ones)
        choice = logits
        if adjusted_rows:
            choice = logits if logits.data_ptr() != raw.data_ptr() else logits.clone()
            self._adjust_(choice, rows, adjusted_rows, token_ids)
            if choice is logits:  # the float copy now holds the adjusted values
                logits = raw.float() if k_max > 0 else raw
        if sampled_rows:
            index = torch.tensor(sampled_rows, device=device)
            probs = self._filtered_probs(choice[index], [rows[i] for i in sampled_rows], vocab)
            q = torch.empty_like(probs)
            shared = self._shared_generator(device)
            for j, i in enumerate(sampled_rows):
                seed = rows[i].seed
                gen = shared
                if seed is not None:
                    gen = torch.Generator(device=device)
                    gen.manual_seed(mix_seed(seed, rows[i].num_generated))
                q[j].exponential_(generator=gen)
            # q may (rarely) be 0: clamp so masked tokens (p = 0) stay at 0, never 0/0
            token_ids[index] = (probs / q.clamp_min_(1e-30)).argmax(dim=-1)

        chosen = logits.gather(-1, token_ids[:, None]).squeeze(-1).float() - log_normalizer
        top: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        if k_max > 0:
            values, indices = logits.topk(k_max, dim=-1)
            values, indices = (values - log_normalizer[:, None]).tolist(), indices.tolist()
            for i, r in enumerate(rows):
                k = min(r.top_logprobs, vocab)
                top[i] = list(zip(indices[i][:k], values[i][:k], strict=True))
        return SampleResult(token_ids=token_ids.tolist(), logprobs=chosen.tolist(), top_logprobs=top)

    @staticmethod
    def _adjust_(choice: torch.Tensor, rows: Seq[RowSampling], adjusted: list[int], token_ids: torch.Tensor) -> None:
        """In place on float32 ``choice``: each adjusted row's penalties (repetition first, then
        frequency and presence, as vLLM does), its logit_bias, its banned tokens and those its guide
        does not allow at -inf; those rows' greedy choice in ``token_ids`` is redone on it."""
        vocab = choice.shape[-1]
        device = choice.device
        for i in adjusted:
            r, row = rows[i], choice[i]
            if r.repetition_penalty != 1 and (r.prompt or r.generated):
                seen = torch.tensor(sorted({t for t in (*r.prompt, *r.generated) if t < vocab}), device=device)
                x = row[seen]
                row[seen] = torch.where(x > 0, x / r.repetition_penalty, x * r.repetition_penalty)
            if (r.presence_penalty or r.frequency_penalty) and r.generated:
                counts = torch.bincount(torch.tensor([t for t in r.generated if t < vocab], dtype=torch.int64,
                                                     device=device), minlength=vocab)[:vocab].to(row.dtype)
                row -= r.frequency_penalty * counts + r.presence_penalty * (counts > 0).to(row.dtype)
            bias = [(t, b) for t, b in r.logit_bias if t < vocab]
            if bias:
                ids = torch.tensor([t for t, _ in bias], device=device)
                row[ids] += torch.tensor([b for _, b in bias], dtype=row.dtype, device=device)
            banned = [t for t in r.banned if t < vocab]
            if banned:
                row[torch.tensor(banned, device=device)] = float("-inf")
        guided = [i for i in adjusted if rows[i].allowed]
        if guided:  # structured outputs: what each guide allows next, one bit per token id
            masks = torch.frombuffer(bytearray(b"".join(rows[i].allowed for i in guided)),
                                     dtype=torch.uint8).view(len(guided), -1)
            if len(guided) == choice.shape[0]:
                mask_tokens_(choice, masks)
            else:
                part = choice[guided]
                mask_tokens_(part, masks)
                choice[guided] = part
        if len(adjusted) == choice.shape[0]:
            token_ids.copy_(greedy_logsumexp(choice)[0])
        else:
            index = torch.tensor(adjusted, device=device)
            token_ids[index] = greedy_logsumexp(choice[index])[0]

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: Seq[RowSampling], vocab: int) -> torch.Tensor:
        """Probabilities after temperature, min-p, top-k and top-p, renormalised; [rows, vocab].

        Which computation a row goes through depends on its own parameters only (never on the
        rest of the batch), so a row's probabilities are bit-identical alone or batched."""
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        z_all = logits / temps[:, None]
        probs = torch.softmax(z_all, dim=-1)
        min_p = [i for i, p in enumerate(params) if p.min_p > 0]
        if min_p:  # drop what is less likely than min_p x the most likely token (vLLM's order: before top-k/p)
            index = torch.tensor(min_p, device=logits.device)
            p = probs[index]
            floor = torch.tensor([params[i].min_p for i in min_p], dtype=p.dtype, device=p.device)[:, None]
            z_all[index] = z_all[index].masked_fill(p < floor * p.max(dim=-1, keepdim=True).values, float("-inf"))
            probs[index] = torch.softmax(z_all[index], dim=-1)
        filtered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        if not filtered:
            return probs
        rows = torch.tensor(filtered, device=logits.device)
        z = z_all[rows]
        top_ks = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in filtered]
        # top_p = 1 means off: a threshold above 1 is never reached, even by a rounded cumsum
        top_ps = [params[i].top_p if params[i].top_p < 1.0 else 2.0 for i in filtered]
        # sort once, descending and stable (ties keep the lower token id first, as argmax does)
        z_sorted, order = z.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=z.device)[None, :]
        k = torch.tensor(top_ks, device=z.device)[:, None]
        z_sorted = z_sorted.masked_fill(rank >= k, float("-inf"))
        p_sorted = torch.softmax(z_sorted, dim=-1)
        top_p = torch.tensor(top_ps, dtype=p_sorted.dtype, device=z.device)[:, None]
        # drop a token when the tokens before it already reach top_p; the first always stays
        before = p_sorted.cumsum(dim=-1) - p_sorted
        p_sorted = p_sorted.masked_fill((before >= top_p) & (rank > 0), 0.0)
        p_sorted = p_sorted / p_sorted.sum(dim=-1, keepdim=True)
        probs[rows] = torch.zeros_like(p_sorted).scatter_(-1, order, p_sorted)
        return probs
