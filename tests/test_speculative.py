"""N-gram speculative decoding: the drafter, the verifier's exactness, and the runtime end to end."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.sampler import Sampler
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.speculative.ngram_proposer import (
    MAX_FAILED_DRAFTS,
    Acceptance,
    NgramProposer,
    longest_suffix_match,
    worth_length,
)
from sgl_lite.runtime.speculative.step_cost import DECODE_ROW_STEP_COST, DRAFT_TOKEN_STEP_COST, draft_token_cost
from sgl_lite.runtime.speculative.verification import verify_drafts
from sgl_lite.testing.hf_reference import hf_greedy, hf_model

# Tests of verification, not of the draft-length policy (conftest.py).
pytestmark = pytest.mark.usefixtures("draft_lengths_from_the_prior")

# ---------------------------------------------------------------- the drafter


def brute_force_match(tokens: list[int], min_window: int, max_window: int) -> int | None:
    length = len(tokens)
    for n in range(min(max_window, length - 1), min_window - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return end
    return None


def test_longest_suffix_match_equals_brute_force() -> None:
    rng = random.Random(0)
    for case in range(400):
        tokens = [rng.randrange(4 if case % 2 else 12) for _ in range(rng.randrange(1, 60))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 8)
        assert longest_suffix_match(np.array(tokens), lo, hi) == brute_force_match(tokens, lo, hi), (tokens, lo, hi)


def req_with(prompt: list[int], output: list[int] = (), **params) -> Req:
    req = Req(rid=f"r{random.random()}", input_ids=list(prompt), sampling_params=SamplingParams(**params))
    req.output_ids = list(output)
    return req


def test_propose_continues_the_latest_longest_match_and_grows_incrementally() -> None:
    proposer = NgramProposer(num_draft_tokens=4, min_window=1, max_window=4)
    # "5 6 7" occurred twice; the latest occurrence is followed by 8 9 1 2.
    req = req_with([5, 6, 7, 1, 2, 5, 6, 7, 8, 9, 1, 2, 3], [5, 6, 7])
    assert proposer.propose(req, limit=10) == [8, 9, 1, 2]
    assert proposer.propose(req, limit=2) == [8, 9]
    req.output_ids += [8, 9]  # the buffer appends only the new outputs
    assert proposer.propose(req, limit=10) == [1, 2, 3, 5]
    assert proposer.propose(req_with([1, 2, 3, 4]), limit=4) == []  # nothing repeats: no draft


def test_draft_length_is_what_pays_at_the_batch_size() -> None:
    # The j-th draft token is worth verifying while its chance, first * then ** (j - 1), exceeds its share of the step.
    assert draft_token_cost(1) < draft_token_cost(8) < draft_token_cost(32) < 1.0
    steady = Acceptance(0.9, 0.9)
    assert worth_length(steady, 1, cap=64) > worth_length(steady, 8, cap=64) > worth_length(steady, 32, cap=64) > 0
    for acceptance in (Acceptance(0.7, 0.7), Acceptance(0.4, 0.9), Acceptance(0.9, 0.3)):
        for batch in (1, 8, 32):
            j, cost = worth_length(acceptance, batch, cap=64), draft_token_cost(batch)
            assert (acceptance.token(j) > cost if j else True) and cost >= acceptance.token(j + 1), (acceptance, batch)
    # a bursty request (first tokens often wrong, spans taken whole) drafts longer than a steady one of its first rate
    assert worth_length(Acceptance(0.4, 0.9), 8, cap=64) > worth_length(Acceptance(0.4, 0.4), 8, cap=64)
    assert worth_length(Acceptance(0.3, 0.9), 32, cap=64) == 0 and worth_length(Acceptance(1.0, 1.0), 4, cap=6) == 6
    # a step that large is compute-bound: a draft token costs about what a decode row does, so only
    # near-certain drafts pay
    assert abs(draft_token_cost(10**6) - DRAFT_TOKEN_STEP_COST / DECODE_ROW_STEP_COST) < 1e-3
    assert worth_length(steady, 10_000, cap=8) == 0


def test_acceptance_separates_the_first_token_from_the_rest_of_a_draft() -> None:
    proposer = NgramProposer(num_draft_tokens=12, min_window=1, max_window=4)
    req = req_with(list(range(1, 40)) + [1, 2])
    proposer.propose(req, limit=40)
    for _ in range(6):  # spans copied whole or not at all: half the drafts miss at once, half are taken whole
        proposer.record(req, 10, 10)
        proposer.record(req, 10, 0)
    acceptance = req.spec_state.acceptance()
    assert 0.3 < acceptance.first < 0.7 and acceptance.then > 0.85
    assert abs(acceptance.expected(10) - sum(acceptance.token(j) for j in range(1, 11))) < 1e-9


def test_draft_length_follows_acceptance_and_failing_requests_back_off() -> None:
    proposer = NgramProposer(num_draft_tokens=8, min_window=1, max_window=4)
    req = req_with(list(range(1, 40)) + [1, 2])
    first = len(proposer.propose(req, limit=40))
    for _ in range(4):
        proposer.record(req, 8, 8)  # a request that keeps copying drafts the cap at batch 1...
    assert len(proposer.propose(req, limit=40)) == 8 > first
    for _ in range(3):
        proposer.record(req, 8, 1)  # then mostly rejected: shorter drafts, the shorter the bigger the batch
    lengths = [len(proposer.propose(req, limit=40, batch_size=b)) for b in (1, 8, 64)]
    assert lengths[0] > lengths[1] > lengths[2] > 0, lengths
    for _ in range(MAX_FAILED_DRAFTS):
        proposer.record(req, 1, 0)
    assert proposer.propose(req, limit=10) == []  # backing off
    assert proposer.stats()["spec_accepted_tokens"] == 35 and req.spec_draft_tokens == 56 + MAX_FAILED_DRAFTS


def test_a_new_request_starts_from_what_the_servers_recent_drafts_say() -> None:
    def fresh_length(outcome: tuple[int, int]) -> int:
        proposer = NgramProposer(num_draft_tokens=12, min_window=1, max_window=4)
        for i in range(20):  # other requests' drafts
            other = req_with([i])
            proposer.propose(other, limit=1)
            proposer.record(other, *outcome)
        return len(proposer.propose(req_with(list(range(1, 40)) + [1, 2]), limit=40, batch_size=8))

    at_the_fixed_prior = len(NgramProposer(12, 1, 4).propose(req_with(list(range(1, 40)) + [1, 2]), limit=40, batch_size=8))
    assert fresh_length((12, 12)) > at_the_fixed_prior > fresh_length((12, 0)) == 0


# ---------------------------------------------------------------- the verifier


def test_greedy_verification_accepts_the_matching_prefix_then_the_models_token() -> None:
    vocab = 10
    targets = [3, 4, 5, 6]  # argmax at the 4 positions of a 3-token draft
    logits = torch.full((4, vocab), -5.0)
    logits[torch.arange(4), torch.tensor(targets)] = 5.0
    greedy = req_with([0], temperature=0.0)
    sampler = Sampler(vocab, [])
    assert verify_drafts(sampler, logits, [greedy], [[3, 4, 5]]) == [[3, 4, 5, 6]]  # all accepted + bonus
    assert verify_drafts(sampler, logits, [greedy], [[3, 9, 5]]) == [[3, 4]]  # stops at the mismatch
    assert verify_drafts(sampler, logits, [greedy], [[7, 4, 5]]) == [[3]]


def test_sampled_verification_keeps_the_target_distribution() -> None:
    # Position 0 of a 1-token draft: whatever the draft, the first emitted token must be distributed as
    # p = softmax(logits / T) (accepted with probability p(d), else drawn from p without d).
    vocab, trials = 6, 6000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0] * vocab])
    expected = torch.softmax(logits[0] / 0.8, dim=-1).numpy()
    sampler = Sampler(vocab, [])
    for draft in (0, 4):  # a likely draft and an unlikely one
        counts = np.zeros(vocab)
        req = req_with([0], temperature=0.8, seed=draft + 1)
        for _ in range(trials):
            counts[verify_drafts(sampler, logits, [req], [[draft]])[0][0]] += 1
        observed = counts / trials
        # 5 standard errors of a binomial proportion: fails on a biased rule, not on noise.
        tolerance = 5 * np.sqrt(expected * (1 - expected) / trials)
        assert np.all(np.abs(observed - expected) <= tolerance), (draft, observed, expected)


def test_sampled_verification_applies_top_k() -> None:
    vocab = 5
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 2)
    req = req_with([0], temperature=1.0, top_k=2, seed=3)
    sampler = Sampler(vocab, [])
    seen = {verify_drafts(sampler, logits, [req], [[4]])[0][0] for _ in range(300)}
    assert seen <= {0, 1}  # the draft (rank 5) has probability 0 under top-k 2: always rejected


def test_sampled_verification_draws_plain_samplings_tokens_from_the_same_generator() -> None:
    # Seeded: verifying a draft emits the tokens plain sampling would, row by row, with the same seed,
    # and leaves the generator where plain sampling would (the token after the draft matches too).
    vocab, positions = 50, 5
    logits = torch.randn(positions + 1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    sampler = Sampler(vocab, [])
    plain = req_with([0], **params)
    plain_ids = [int(sampler.sample(logits[j : j + 1], [plain], with_logprobs=False)[0]) for j in range(positions + 1)]
    full = req_with([0], **params)
    assert verify_drafts(sampler, logits[:positions], [full], [plain_ids[: positions - 1]]) == [plain_ids[:positions]]
    assert int(sampler.sample(logits[positions:], [full], with_logprobs=False)[0]) == plain_ids[positions]
    wrong = (plain_ids[2] + 1) % vocab  # a draft that leaves plain sampling's path at position 2
    cut = req_with([0], **params)
    draft = plain_ids[:2] + [wrong, plain_ids[3]]
    assert verify_drafts(sampler, logits[:positions], [cut], [draft]) == [plain_ids[:3]]
    assert [int(sampler.sample(logits[j : j + 1], [cut], with_logprobs=False)[0]) for j in (3, 4)] == plain_ids[3:5]


# ---------------------------------------------------------------- the runtime end to end


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path):
    common = dict(model_path=str(tiny_llama_dir), max_total_tokens=4096, max_running_requests=16,
                  dtype="float32", device="cpu", chunked_prefill_size=64)
    plain = Engine(**common)
    spec = Engine(**common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    yield plain, spec
    for eng in (plain, spec):
        eng.shutdown()
        eng.core.scheduler.check_invariant()


@pytest.fixture(autouse=True)
def _invariant(request):
    yield
    if "engines" in request.fixturenames:
        for eng in request.getfixturevalue("engines"):
            eng.core.scheduler.check_invariant()
            assert not eng.core.scheduler.has_work()


COPY_PROMPTS = [
    "Repeat after me: the tool returned status ok, id 42, name alpha. Repeat after me: the tool returned",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "one two three four five one two three four five one two three",
]


def test_greedy_output_is_identical_with_speculation(engines, tiny_llama_dir: Path) -> None:
    plain, spec = engines
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    expected = plain.generate(COPY_PROMPTS, params)
    got = spec.generate(COPY_PROMPTS, params)  # batched: every row verifies its own draft
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
    assert [g["text"] for g in got] == [e["text"] for e in expected]
    # The drafts were really used: some verified forwards accepted tokens.
    assert sum(g["meta_info"].get("spec_verify_ct", 0) for g in got) > 0
    assert spec.core.scheduler.stats()["spec_accepted_tokens"] > 0
    # And the runtime's greedy output is still transformers' own.
    ids = spec.core.tokenizer(COPY_PROMPTS[2])["input_ids"]
    assert got[2]["output_ids"] == hf_greedy(hf_model(tiny_llama_dir), ids, 40)
    # A prefix-cache hit changes nothing.
    again = spec.generate(COPY_PROMPTS[0], params)
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == expected[0]["output_ids"]


def test_limits_stops_and_streaming_match_plain_decoding(engines) -> None:
    plain, spec = engines
    for params in ({"temperature": 0, "max_new_tokens": 7, "ignore_eos": True},
                   {"temperature": 0, "max_new_tokens": 30, "stop": [" two"], "ignore_eos": True},
                   {"temperature": 0, "max_new_tokens": 30, "min_new_tokens": 5}):
        for prompt in COPY_PROMPTS:
            want, got = plain.generate(prompt, params), spec.generate(prompt, params)
            assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], params
            assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    chunks = list(spec.generate(COPY_PROMPTS[2], params, stream=True))  # SGLang's shape: text so far
    assert len(chunks) > 1 and chunks[-1]["text"] == plain.generate(COPY_PROMPTS[2], params)["text"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))


def _speculating(tiny_llama_dir: Path, **args) -> Engine:
    return Engine(model_path=str(tiny_llama_dir), dtype="float32", device="cpu", chunked_prefill_size=64,
                  speculative_algorithm="NGRAM", speculative_num_draft_tokens=5, log_level="error", **args)


def test_retracted_drafting_requests_resume_to_the_same_greedy_output(engines, tiny_llama_dir: Path) -> None:
    """Under a pool too small for every running request (9 of them, 40 tokens each), decode steps retract
    requests that speculate; re-admitted, they end with plain decoding's tokens, and nothing leaks."""
    plain, _ = engines
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    prompts = [p + suffix for suffix in ("", " again", " once more") for p in COPY_PROMPTS]
    expected = [e["output_ids"] for e in plain.generate(prompts, params)]
    retractions = 0
    for slots in (350, 400, 450):  # whether a given size retracts depends on admission's estimates: try several
        tight = _speculating(tiny_llama_dir, max_total_tokens=slots, max_running_requests=16)
        try:
            got = tight.generate(prompts, params)
            assert [g["output_ids"] for g in got] == expected, slots
            stats = tight.core.scheduler.stats()
            assert stats["spec_accepted_tokens"] > 0
            retractions += stats["num_retractions"]
            tight.core.scheduler.check_invariant()
        finally:
            tight.shutdown()
    assert retractions > 0


def test_a_drafting_request_preempted_by_an_urgent_one_resumes_to_the_same_greedy_output(engines, tiny_llama_dir: Path) -> None:
    plain, _ = engines
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    expected = [e["output_ids"] for e in plain.generate(COPY_PROMPTS, params)]
    engine = _speculating(tiny_llama_dir, max_total_tokens=4096, max_running_requests=2, enable_priority_scheduling=True)
    try:
        core = engine.core
        low = [core.make_req(f"low{i}", p, None, params, priority=0) for i, p in enumerate(COPY_PROMPTS[:2])]
        for r in low:
            core.submit(r)
        for _ in range(4):  # both running and decoding
            core.step()
        urgent = core.make_req("urgent", COPY_PROMPTS[2], None, params, priority=100)
        core.submit(urgent)
        while core.scheduler.has_work():
            core.step()
        stats = core.scheduler.stats()
        assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens"] > 0
        assert [r.output_ids for r in (*low, urgent)] == expected
        core.scheduler.check_invariant()
    finally:
        engine.shutdown()


def test_sampled_requests_and_logprob_requests_run_and_leak_nothing(engines) -> None:
    _, spec = engines
    params = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 30, "seed": 5, "ignore_eos": True}
    outs = spec.generate(COPY_PROMPTS, params)
    assert all(len(o["output_ids"]) == 30 for o in outs)

def test_seeded_sampling_gives_the_same_output_with_speculation_on_and_off(engines) -> None:
    plain, spec = engines
    for params in ({"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 40, "seed": 7, "ignore_eos": True},
                   {"temperature": 1.0, "max_new_tokens": 40, "seed": 8, "ignore_eos": True}):
        want = [o["output_ids"] for o in plain.generate(COPY_PROMPTS, params)]
        accepted_before = spec.core.scheduler.stats()["spec_accepted_tokens"]
        for _ in range(4):  # batched, as the same seeded batch sent again and again
            got = spec.generate(COPY_PROMPTS, params)
            assert [o["output_ids"] for o in got] == want, params
        alone = spec.generate(COPY_PROMPTS[2], params)
        assert alone["output_ids"] == want[2] and alone["meta_info"]["spec_verify_ct"] > 0
        # Drafts were verified and accepted, so the equality is not that of plain decoding with itself.
        assert spec.core.scheduler.stats()["spec_accepted_tokens"] > accepted_before


def test_logprobs_of_verified_tokens_match_plain_decoding(engines) -> None:
    plain, spec = engines
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    want = plain.generate(COPY_PROMPTS[2], params, return_logprob=True)["meta_info"]
    got = spec.generate(COPY_PROMPTS[2], params, return_logprob=True)["meta_info"]
    assert got["spec_verify_ct"] > 0
    assert [t for _, t, _ in got["output_token_logprobs"]] == [t for _, t, _ in want["output_token_logprobs"]]
    assert [lp for lp, _, _ in got["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _, _ in want["output_token_logprobs"]], abs=1e-4)


def test_bad_speculative_flags_are_refused() -> None:
    from sgl_lite.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="--speculative-algorithm"):
        ServerArgs(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="window"):
        ServerArgs(speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=2)



BF16_PROMPTS = [
    "Repeat after me: the tool returned status ok, id 42, name alpha. Repeat after me: the tool returned",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "The capital of France is",
    "List three colors:",
    "Write a haiku about the sea.",
    "Translate to French: good morning, my friend.",
    "What is 17 times 3?",
    "Explain what a hash table is in one sentence.",
    '{"name": "alpha", "id": 42, "status": "ok"} Copy this JSON exactly: {"name":',
    "Once upon a time, in a small village,",
]


@pytest.mark.default_model
def test_bf16_greedy_output_is_identical_with_speculation_on_the_default_model(default_model_dir: Path) -> None:
    """In bf16 too: up to GEMV_MAX_ROWS rows a matmul row and a decode-attention row are computed the same way
    in any batch (kernels/csrc/matmul/bf16_gemv.cpp, fixed-length chunks in the decode kernel), so a verification
    row gives a decode step's bits. The tiny model's wide logit margins hide such last-bit differences,
    hence the real weights."""
    from sgl_lite.runtime.layers.linear import gemv_supported

    if not gemv_supported(torch.empty(16, 2, dtype=torch.bfloat16)):
        pytest.skip("no AVX512-BF16 build of the CPU ops here")
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    outputs = {}
    for name, extra in (("plain", {}), ("spec", dict(speculative_algorithm="NGRAM"))):
        engine = Engine(model_path=str(default_model_dir), dtype="bfloat16", max_total_tokens=4096, **extra)
        try:
            outputs[name, "batched"] = [g["output_ids"] for g in engine.generate(BF16_PROMPTS, params)]
            outputs[name, "alone"] = [engine.generate(p, params)["output_ids"] for p in BF16_PROMPTS[:4]]
            if name == "spec":
                assert engine.core.scheduler.stats()["spec_accepted_tokens"] > 0
        finally:
            engine.shutdown()
    assert outputs["spec", "batched"] == outputs["plain", "batched"]
    assert outputs["spec", "alone"] == outputs["plain", "alone"]  # failed before: prompt 1 differed
