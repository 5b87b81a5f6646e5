"""Sampler: greedy, seeded sampling, top-k/top-p/min-p sets, penalties by their formulas, min_new_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.sampling.sampler import Sampler
from sgl_lite.testing.req_factory import make_req

VOCAB = 16
EOS = 2


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def logits_for_probs(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs)).unsqueeze(0)


def test_greedy_equals_argmax_and_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(8)
    reqs = [make_req(f"r{i}", temperature=0.0) for i in range(8)]
    ids, logprobs = Sampler(VOCAB, [EOS]).sample(logits, reqs)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids, logits.argmax(dim=-1))
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(8), ids]
    torch.testing.assert_close(logprobs, expected)


def test_top_k_1_equals_greedy_even_with_temperature() -> None:
    logits = random_logits(6, seed=1)
    reqs = [make_req(f"r{i}", temperature=1.5, top_k=1) for i in range(6)]
    ids, _ = Sampler(VOCAB, [EOS]).sample(logits, reqs)
    assert torch.equal(ids, logits.argmax(dim=-1))


def draws(sampler: Sampler, logits: torch.Tensor, req: Req, steps: int) -> list[int]:
    return [int(sampler.sample(logits, [req])[0]) for _ in range(steps)]


def test_seeded_sampling_repeats_and_differs_across_seeds() -> None:
    sampler = Sampler(64, [EOS])
    flat = torch.zeros(1, 64)
    first = draws(sampler, flat, make_req("a", seed=7), 12)
    again = draws(sampler, flat, make_req("b", seed=7), 12)
    other = draws(sampler, flat, make_req("c", seed=8), 12)
    assert first == again
    assert first != other


def test_default_seed_makes_unseeded_requests_reproducible_per_rid() -> None:
    flat = torch.zeros(1, 64)
    one = draws(Sampler(64, [EOS], default_seed=3), flat, make_req("same-rid"), 12)
    two = draws(Sampler(64, [EOS], default_seed=3), flat, make_req("same-rid"), 12)
    three = draws(Sampler(64, [EOS], default_seed=3), flat, make_req("other-rid"), 12)
    assert one == two
    assert one != three


def sample_many(logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    """n independent draws: a batch of n requests with seeds 0..n-1 over the same logits row."""
    reqs = [make_req(f"r{i}", seed=i, **params) for i in range(n)]
    ids, _ = Sampler(logits_row.shape[-1], [EOS]).sample(logits_row.expand(n, -1).clone(), reqs)
    return ids


PROBS = [0.02, 0.30, 0.05, 0.20, 0.01, 0.25, 0.12, 0.05]


def test_top_k_picks_only_the_k_most_likely() -> None:
    ids = sample_many(logits_for_probs(PROBS), 2000, temperature=1.0, top_k=3)
    assert set(ids.tolist()) == {1, 5, 3}


def test_top_p_picks_only_the_smallest_set_reaching_p() -> None:
    # Sorted: 0.30 (1), 0.25 (5), 0.20 (3), 0.12 (6) ...; mass before token 3 is 0.55 <= 0.6, before 6 is 0.75.
    ids = sample_many(logits_for_probs(PROBS), 2000, temperature=1.0, top_p=0.6)
    assert set(ids.tolist()) == {1, 5, 3}


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    # Threshold 0.5 * 0.30 = 0.15: tokens 1 (0.30), 5 (0.25), 3 (0.20) stay.
    ids = sample_many(logits_for_probs(PROBS), 2000, temperature=1.0, min_p=0.5)
    assert set(ids.tolist()) == {1, 5, 3}


def allowed_tokens(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The definition, token by token: rank < top_k, mass of the more likely tokens <= top_p, p >= min_p * max."""
    ranked = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    allowed, mass_before = set(), 0.0
    for rank, token in enumerate(ranked):
        p = float(probs[token])
        if (top_k < 0 or rank < top_k) and mass_before <= top_p and p >= min_p * float(probs[ranked[0]]):
            allowed.add(token)
        mass_before += p
    return allowed


@pytest.mark.parametrize(
    ("scale", "top_k", "top_p", "min_p"),
    [
        (4.0, 5, 1.0, 0.0),  # top-k within the partial-sort candidates
        (4.0, -1, 0.5, 0.0),  # peaked: the top-p set is inside the candidates
        (0.3, -1, 0.5, 0.0),  # flat: the top-p set is larger than the candidates (full sort)
        (4.0, -1, 1.0, 0.2),  # min-p
        (0.3, 600, 0.9, 0.0),  # top-k larger than the candidates
    ],
)
def test_filters_on_a_large_vocabulary(scale: float, top_k: int, top_p: float, min_p: float) -> None:
    vocab = 2000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * scale
    allowed = allowed_tokens(torch.softmax(logits[0], -1), top_k, top_p, min_p)
    ids = sample_many(logits, 1500, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    assert set(ids.tolist()) <= allowed
    # The mass of allowed tokens ranked past 256 is sampled in proportion (none lost to a partial sort).
    probs = torch.softmax(logits[0], -1)
    tail = set(probs.argsort(descending=True)[256:].tolist()) & allowed
    expected = sum(float(probs[t]) for t in tail) / sum(float(probs[t]) for t in allowed)
    observed = sum(1 for t in ids.tolist() if t in tail) / len(ids)
    assert abs(observed - expected) < 0.05  # 1500 draws: standard error <= 0.013


def test_sampling_frequencies_follow_the_distribution() -> None:
    ids = sample_many(logits_for_probs(PROBS), 4000, temperature=1.0)
    freq = torch.bincount(ids, minlength=len(PROBS)).float() / 4000
    # 4000 draws: the standard error is <= 0.008; 0.04 is five of them.
    assert torch.allclose(freq, torch.tensor(PROBS), atol=0.04)


def test_temperature_sharpens_the_distribution() -> None:
    cold = sample_many(logits_for_probs(PROBS), 2000, temperature=0.2)
    # p^(1/0.2) renormalized: token 1 gets 0.30^5 / sum(p^5) ~ 0.64.
    expected = 0.30**5 / sum(p**5 for p in PROBS)
    assert abs((cold == 1).float().mean().item() - expected) < 0.05


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -4.0, 1.0, 0.5]])
    req = make_req(input_ids=[0, 1], output_ids=[1, 3], repetition_penalty=2.0)
    processed = Sampler(6, [EOS]).process_logits(logits, [req])
    # Seen (prompt + output): 0, 1, 3. 2.0/2, -1.0*2, -4.0*2; the rest unchanged.
    expected = torch.tensor([[1.0, -2.0, 3.0, -8.0, 1.0, 0.5]])
    torch.testing.assert_close(processed, expected)


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    req = make_req(input_ids=[5, 5, 5], output_ids=[1, 1, 1, 4], frequency_penalty=0.5, presence_penalty=0.25)
    processed = Sampler(6, [EOS]).process_logits(logits, [req])
    # token 1: 1 - 3*0.5 - 0.25 = -0.75 ; token 4: 1 - 0.5 - 0.25 = 0.25 ; prompt token 5 untouched.
    expected = torch.tensor([[1.0, -0.75, 1.0, 1.0, 0.25, 1.0]])
    torch.testing.assert_close(processed, expected)


def test_penalties_apply_per_row_in_a_mixed_batch() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0], [3.0, 2.9, 0.0, 0.0]])
    penalized = make_req("p", input_ids=[2], output_ids=[0], temperature=0.0, repetition_penalty=1.5)
    plain = make_req("q", input_ids=[2], output_ids=[0], temperature=0.0)
    ids, logprobs = Sampler(4, [EOS]).sample(logits, [penalized, plain])
    assert ids.tolist() == [1, 0]  # 3.0 / 1.5 = 2.0 < 2.9 only in the penalized row
    # Logprobs stay under the raw logits.
    torch.testing.assert_close(logprobs[0], torch.log_softmax(logits[0], -1)[1])


def test_min_new_tokens_suppresses_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.full((1, 6), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 4] = 9.0
    logits[0, 1] = 1.0
    sampler = Sampler(6, [EOS])
    early = make_req(output_ids=[1], temperature=0.0, min_new_tokens=3, stop_token_ids=[4])
    assert int(sampler.sample(logits, [early])[0]) == 1
    reached = make_req(output_ids=[1, 1, 1], temperature=0.0, min_new_tokens=3, stop_token_ids=[4])
    assert int(sampler.sample(logits, [reached])[0]) == EOS


def test_min_new_tokens_suppresses_eos_when_sampling() -> None:
    logits = torch.zeros(1, 4)
    logits[0, EOS] = 8.0
    ids = sample_many(logits, 500, temperature=1.0, min_new_tokens=1)
    assert EOS not in ids.tolist()


def test_empty_batch_and_row_mismatch() -> None:
    sampler = Sampler(VOCAB, [EOS])
    ids, logprobs = sampler.sample(torch.empty(0, VOCAB), [])
    assert ids.shape == (0,) and logprobs.shape == (0,)
    with pytest.raises(ValueError, match="rows"):
        sampler.sample(torch.zeros(2, VOCAB), [make_req()])


class AllowOnly:
    """A stand-in grammar matcher state: the tokens it allows (the sampler only forwards it)."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed


def test_grammar_hook_masks_through_apply_grammar_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> None:
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                keep = torch.zeros(logits.shape[1], dtype=torch.bool)
                keep[matcher.allowed] = True
                logits[row].masked_fill_(~keep, -math.inf)

    fake = types.ModuleType("sgl_lite.runtime.sampling.grammar")
    fake.apply_grammar_masks = apply_grammar_masks
    monkeypatch.setitem(sys.modules, "sgl_lite.runtime.sampling.grammar", fake)
    import sgl_lite.runtime.sampling

    monkeypatch.setattr(sgl_lite.runtime.sampling, "grammar", fake, raising=False)
    logits = random_logits(2, seed=4)
    constrained = make_req("g", temperature=0.0)
    constrained.grammar = AllowOnly([7, 9])
    free = make_req("f", temperature=0.0)
    ids, _ = Sampler(VOCAB, [EOS]).sample(logits, [constrained, free])
    assert int(ids[0]) == (7 if logits[0, 7] > logits[0, 9] else 9)
    assert int(ids[1]) == int(logits[1].argmax())
    sampled_reqs = [make_req(f"s{i}", seed=i, temperature=1.0) for i in range(200)]
    for req in sampled_reqs:
        req.grammar = AllowOnly([7, 9])
    sampled, _ = Sampler(VOCAB, [EOS]).sample(logits[0:1].expand(200, -1).clone(), sampled_reqs)
    assert set(sampled.tolist()) <= {7, 9}
