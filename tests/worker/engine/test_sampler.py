"""Sampler: greedy, top-k/top-p limits, seeded reproducibility alone vs batched, raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.sampling import SamplingParams
from services.worker.engine.sampler import Sampler, SamplerError, mix_seed
from services.worker.engine.step import RowSampling

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

VOCAB = 300


def logits_batch(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 3


def test_greedy_is_argmax_with_raw_logprobs() -> None:
    logits = logits_batch(5)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 5, [0] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values.tolist()
    # logit − logsumexp: log_softmax up to float32 rounding
    assert out.logprobs == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert out.top_logprobs == [[]] * 5


def test_greedy_ties_take_the_lowest_id() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, [7, 3, 9]] = 5.0
    assert Sampler()(logits, [SamplingParams(temperature=0)], [0]).token_ids == [3]
    assert Sampler(seed=1)(logits, [SamplingParams(temperature=0.7, top_k=1)], [0]).token_ids == [3]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=2.0, top_p=1e-6),
    SamplingParams(temperature=0.9, top_k=1, seed=5),
    SamplingParams(temperature=5.0, top_k=50, top_p=1e-9, seed=7),
])
def test_top_k_one_and_tiny_top_p_equal_greedy(params: SamplingParams) -> None:
    logits = logits_batch(8, seed=3)
    for step in range(3):
        out = Sampler(seed=step)(logits, [params] * 8, [step] * 8)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_request_is_the_same_alone_and_batched() -> None:
    sampler = Sampler(seed=123)
    mine = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=42)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.5, top_p=0.5, seed=9), SamplingParams(temperature=1.0, top_k=3)]
    row = logits_batch(1, seed=11)
    alone = [Sampler()(row, [mine], [n]).token_ids[0] for n in range(20)]
    for n in range(20):
        batch = torch.cat([logits_batch(2, seed=n), row, logits_batch(2, seed=100 + n)])
        params = [others[0], others[1], mine, others[2], others[3]]
        out = sampler(batch, params, [5, 0, n, 3, 1])
        assert out.token_ids[2] == alone[n]
    assert len(set(alone)) > 1  # it really samples: different steps, different tokens


def test_seeded_sampling_repeats_and_seeds_differ() -> None:
    logits = logits_batch(1, seed=2)
    draw = lambda seed: [Sampler()(logits, [SamplingParams(seed=seed)], [n]).token_ids[0]  # noqa: E731
                         for n in range(30)]
    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_sampled_distribution_matches_the_softmax() -> None:
    """Fixed seed, 4000 draws over 4 tokens with p = softmax(logits / T): frequencies within
    4 standard errors, and top-p / top-k cut exactly the tokens they should."""
    base = torch.tensor([2.0, 1.0, 0.5, -1.0])
    n = 4000
    logits = base.repeat(n, 1)
    params = [SamplingParams(temperature=0.8)] * n
    out = Sampler(seed=0)(logits, params, [0] * n)
    p = torch.softmax(base / 0.8, -1)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    se = (p * (1 - p) / n).sqrt()
    assert ((counts - p).abs() <= 4 * se).all(), (counts, p)
    # top_p = 0.8: sorted probs at T=0.8 are ~[0.64, 0.18, 0.097, 0.015]: keep the first two
    out = Sampler(seed=0)(logits, [SamplingParams(temperature=0.8, top_p=0.8)] * n, [0] * n)
    kept = p[:2] / p[:2].sum()
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    assert counts[2:].sum() == 0
    assert abs(counts[0] - kept[0]) <= 4 * math.sqrt(kept[0] * (1 - kept[0]) / n)
    # top_k = 3 never picks the least likely token
    out = Sampler(seed=0)(logits, [SamplingParams(temperature=5.0, top_k=3)] * n, [0] * n)
    assert 3 not in out.token_ids and set(out.token_ids) == {0, 1, 2}


def test_top_p_keeps_smallest_set_reaching_the_threshold() -> None:
    # probabilities exactly 0.5, 0.25, 0.125, 0.125 (T = 1)
    logits = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))
    probs = Sampler._filtered_probs(logits, [SamplingParams(top_p=0.75)], 4)
    assert probs.tolist() == [[0.0, pytest.approx(2 / 3), 0.0, pytest.approx(1 / 3)]]
    probs = Sampler._filtered_probs(logits, [SamplingParams(top_p=0.76)], 4)
    assert probs[0, [1, 3]].sum() < 1 and (probs[0] > 0).sum() == 3
    probs = Sampler._filtered_probs(logits, [SamplingParams(top_p=0.5)], 4)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_logprobs_are_raw_and_best_first() -> None:
    logits = logits_batch(3, seed=4)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=2.0, seed=1),
              SamplingParams(temperature=0.5, logprobs=5, seed=2)]
    out = Sampler()(logits, params, [0, 0, 0])
    raw = torch.log_softmax(logits, -1)
    for i, k in ((0, 3), (2, 5)):
        values, ids = raw[i].topk(k)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(values.tolist(), rel=1e-6, abs=1e-6)
    assert out.top_logprobs[1] == []
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), rel=1e-6, abs=1e-6)  # raw: temperature does not change them


def test_mismatched_inputs_are_rejected() -> None:
    with pytest.raises(SamplerError, match="got 1 params but 2 num_generated"):
        Sampler()(logits_batch(2), [SamplingParams()], [0, 0])
    with pytest.raises(SamplerError, match="logits have 2 rows but got 1 sampling rows"):
        Sampler()(logits_batch(2), [SamplingParams()], [0])
    with pytest.raises(SamplerError, match=r"logits must be \[n, vocab\], got shape \(300,\)"):
        Sampler()(torch.zeros(VOCAB), [], [])
    assert Sampler()(torch.zeros(0, VOCAB), [], []).token_ids == []


def test_mix_seed_is_deterministic_and_in_range() -> None:
    assert mix_seed(42, 0) == mix_seed(42, 0)
    values = {mix_seed(s, n) for s in (0, 1, 2**64 - 1) for n in range(50)}
    assert len(values) == 150
    assert all(0 <= v < 2**63 for v in values)


def test_sample_takes_step_rows_and_iterates_as_tuples() -> None:
    """``sample`` reads the per-row fields the driver's step plan carries; same draws as
    ``__call__`` with the request's SamplingParams."""
    from services.worker.engine.step import SeqStep

    logits = logits_batch(3, seed=8)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=3, logprobs=2),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2, top_k=5, seed=4)]
    generated = [4, 0, 9]
    by_params = Sampler()(logits, params, generated)
    steps = [SeqStep(seq_id=i, token_ids=[1], positions=[0], slots=[0], block_table=[0], context_len=1,
                     sample=True, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                     num_generated=n, top_logprobs=p.logprobs)
             for i, (p, n) in enumerate(zip(params, generated, strict=True))]
    by_steps = Sampler().sample(logits, steps)
    assert by_steps == by_params
    assert Sampler().sample(logits, [RowSampling.of(p, n) for p, n in zip(params, generated, strict=True)]) == by_params
    rows = list(by_steps)
    assert len(by_steps) == 3 and rows[1] == (by_params.token_ids[1], by_params.logprobs[1], [])
    assert len(rows[0][2]) == 2


def test_a_row_with_first_step_k_draws_the_steps_after_k_of_a_row_from_zero() -> None:
    """A continuation's sequence generates its token ``n`` as the request's token ``k + n``: the
    same draw as step ``k + n`` of the request run from 0, and not the draw of step ``n``."""
    params = SamplingParams(temperature=0.8, seed=77)
    continued = SamplingParams(temperature=0.8, seed=77, first_step=5)
    logits = logits_batch(1, seed=4)
    from_zero = [Sampler()(logits, [params], [n]).token_ids[0] for n in range(20)]
    after_k = [Sampler()(logits, [continued], [n]).token_ids[0] for n in range(15)]
    assert after_k == from_zero[5:]
    assert after_k != from_zero[:15]  # restarting the step index at 0 would draw another stream
    assert RowSampling.of(continued, 3) == RowSampling.of(params, 8)


def test_logit_bias_moves_the_choice_greedy_included_and_logprobs_stay_raw() -> None:
    logits = logits_batch(3, seed=4)
    target = int(logits[1].argmin())
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={target: 100.0}),
              SamplingParams(temperature=0.8, seed=3, logit_bias={target: 100.0})]
    out = Sampler()(logits, params, [0, 0, 0])
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] == target and out.token_ids[2] == int((logits[2] + 100 * (torch.arange(VOCAB) == target))
                                                                    .argmax())
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] == pytest.approx(float(raw[1, target]), abs=1e-5)  # the model's, not the biased one
    # -100 keeps a token out even where it is the most likely
    best = int(logits[0].argmax())
    assert Sampler()(logits[:1], [SamplingParams(temperature=0, logit_bias={best: -100})], [0]).token_ids[0] != best


def test_banned_tokens_are_never_sampled_and_rows_stay_batch_invariant() -> None:
    logits = logits_batch(1, seed=6)
    best = int(logits[0].argmax())
    greedy = RowSampling(banned=(best,))
    assert Sampler().sample(logits, [greedy]).token_ids == [int(logits[0].topk(2).indices[1])]
    odd_only = tuple(range(0, VOCAB, 2))
    draws = {Sampler().sample(logits, [RowSampling(temperature=3.0, seed=11, num_generated=n, banned=odd_only)])
             .token_ids[0] for n in range(50)}
    assert draws and all(t % 2 == 1 for t in draws) and len(draws) > 5
    mine = RowSampling(temperature=1.0, top_p=0.9, seed=5, num_generated=2, min_p=0.05, logit_bias=((3, 4.0),),
                       banned=(best,), presence_penalty=0.5, repetition_penalty=1.3, generated=(3, 3, 8), prompt=(9,))
    alone = Sampler().sample(logits, [mine]).token_ids[0]
    batch = torch.cat([logits_batch(2, seed=9), logits, logits_batch(1, seed=10)])
    rows = [RowSampling(), RowSampling(temperature=0.7, top_k=5, min_p=0.2), mine,
            RowSampling(temperature=1.0, seed=1, logit_bias=((7, -3.0),))]
    assert Sampler(seed=1).sample(batch, rows).token_ids[2] == alone


def test_penalties_follow_their_definitions() -> None:
    logits = logits_batch(1, seed=12)
    generated, prompt = (5, 5, 9), (9, 11)
    row = RowSampling(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, generated=generated,
                      prompt=prompt)
    expected = logits[0].clone()
    for t in {5, 9, 11}:  # repetition: prompt and generated tokens, positive logits divided, negative multiplied
        expected[t] = expected[t] / 2 if expected[t] > 0 else expected[t] * 2
    for t in {5, 9}:  # then frequency (per occurrence) and presence (once) over the generated ones
        expected[t] -= 0.25 * generated.count(t) + 0.5
    out = Sampler().sample(logits, [row])
    assert out.token_ids == [int(expected.argmax())]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[out.token_ids[0]]), abs=1e-5)


def test_min_p_keeps_only_tokens_near_the_most_likely() -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, [4, 5, 6]] = torch.tensor([2.0, 2.0 + math.log(0.5), 2.0 + math.log(0.05)])  # p ratio 1 : 0.5 : 0.05
    params = SamplingParams(temperature=1.0, min_p=0.1, seed=0)
    draws = [Sampler()(logits, [params], [n]).token_ids[0] for n in range(200)]
    assert set(draws) == {4, 5}  # 6 is below 0.1 x the best; the rest far below
    assert 0.5 < draws.count(4) / len(draws) < 0.85  # renormalised: 2/3 and 1/3


def test_allowed_bits_keep_only_the_tokens_a_guide_allows() -> None:
    logits = logits_batch(2, seed=13)
    allowed = bytearray(VOCAB // 8 + 1)
    for t in (3, 17, 250):
        allowed[t // 8] |= 1 << (t % 8)
    rows = [RowSampling(allowed=bytes(allowed)), RowSampling(temperature=2.0, seed=4, allowed=bytes(allowed))]
    for n in range(20):
        out = Sampler().sample(logits, [rows[0], RowSampling(temperature=2.0, seed=4, num_generated=n,
                                                             allowed=bytes(allowed))])
        assert out.token_ids[0] == max((3, 17, 250), key=lambda t: float(logits[0, t]))
        assert out.token_ids[1] in (3, 17, 250)
