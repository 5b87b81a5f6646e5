"""Fair admission with the deterministic fake runner: a prompt being chunked shares the prefill rounds
with short waiting requests and the steps with running ones; a prompt over the per-request cap is
refused naming the limit. Every scheduler built here is checked by `check_invariant` after each step."""

from __future__ import annotations

import random

import pytest
from fake_runner import FakeRunner, reference_output

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server_args import ServerArgs

VOCAB = 64
CHUNK = 16
LONG_PROMPT = 120  # 8 chunks
HOG_PROMPTS = 8  # a batch of long prompts queued before the short request: 60 chunks in all


def make(**args) -> Scheduler:
    runner = FakeRunner(num_slots=4096, max_running_requests=32, context_length=1024, vocab_size=VOCAB)
    return Scheduler(ServerArgs(chunked_prefill_size=CHUNK, **args), runner, eos_token_ids=(1,), context_length=1024)


def req(rid: str, length: int, max_new: int, seed: int) -> Req:
    rng = random.Random(seed)
    prompt = [rng.randrange(2, VOCAB) for _ in range(length)]
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True))


def step(sched: Scheduler) -> None:
    sched.step()
    sched.check_invariant()


def drain(sched: Scheduler) -> None:
    while sched.has_work():
        step(sched)
    sched.check_invariant()


def expected(r: Req) -> list[int]:
    return reference_output(r.input_ids, r.sampling_params.max_new_tokens, VOCAB)


def steps_until_prefilled_behind_a_hog(steps_before: int = 3, **args) -> tuple[int, Scheduler, list[Req]]:
    """Queue HOG_PROMPTS long prompts, let them run `steps_before` steps, then send a short request: the
    steps until the short one has its first token."""
    sched = make(**args)
    hog = [req(f"hog{i}", LONG_PROMPT, 4, seed=i) for i in range(HOG_PROMPTS)]
    for r in hog:
        sched.add_request(r)
    for _ in range(steps_before):
        step(sched)
    assert sched.chunked_req is not None
    short = req("short", 6, 5, seed=99)
    sched.add_request(short)
    steps = 0
    while not short.output_ids:
        step(sched)
        steps += 1
        assert steps < 1000
    return steps, sched, [*hog, short]


@pytest.mark.parametrize("steps_before", range(3, 9))
def test_a_short_request_behind_long_prompts_is_prefilled_in_the_next_prefill_round(steps_before: int) -> None:
    # Whatever the phase of the alternation it arrives in: at most a decode step, then the round that
    # takes it (its arrival makes that round a shared one, not a chunk-first one).
    steps, sched, reqs = steps_until_prefilled_behind_a_hog(steps_before)
    assert steps <= 2, steps
    assert any(not r.output_ids for r in reqs[:-1])  # while the long prompts are still being prefilled
    drain(sched)
    assert all(r.output_ids == expected(r) for r in reqs)


def test_a_stream_of_newcomers_leaves_the_chunked_prompt_rounds_of_its_own() -> None:
    # Three 5-token requests before every step fill each shared round's 16-token budget but a token:
    # were every round shared on their account, the long prompt would advance a token or two a round.
    # It gets every third round whole: its other 9 chunks within 27 rounds (steps: nothing decodes).
    sched = make()
    long = req("long", 10 * CHUNK, 2, seed=5)
    sched.add_request(long)
    step(sched)
    assert sched.chunked_req is long
    shorts: list[Req] = []
    steps = 0
    while not long.output_ids:
        for _ in range(3):
            shorts.append(req(f"s{len(shorts)}", 5, 1, seed=100 + len(shorts)))
            sched.add_request(shorts[-1])
        step(sched)
        steps += 1
        assert steps <= 28, (steps, long.kv_len)
    drain(sched)
    assert long.output_ids == expected(long) and all(r.output_ids == expected(r) for r in shorts)


def test_without_fair_prefill_the_short_request_waits_for_every_long_prompt() -> None:
    steps, sched, reqs = steps_until_prefilled_behind_a_hog(disable_fair_prefill=True)
    assert steps > HOG_PROMPTS * LONG_PROMPT // CHUNK - 5, steps  # SGLang's order: behind all of them
    drain(sched)
    assert all(r.output_ids == expected(r) for r in reqs)


def test_running_requests_keep_decoding_while_a_long_prompt_is_chunked() -> None:
    sched = make()
    chat = req("chat", 5, 40, seed=7)
    sched.add_request(chat)
    step(sched)  # the chat is prefilled and running
    long = req("long", 10 * CHUNK, 3, seed=8)
    sched.add_request(long)
    chunk_rounds = 0
    before = len(chat.output_ids)
    while sched.chunked_req is not None or not long.output_ids:
        step(sched)
        chunk_rounds += sched.chunked_req is not None
        assert chunk_rounds < 100
    # A decode step followed every chunk: the chat gained a token per chunk while the long prompt ran.
    assert len(chat.output_ids) - before >= 9, (len(chat.output_ids), before)
    drain(sched)
    assert chat.output_ids == expected(chat) and long.output_ids == expected(long)


def test_a_shared_round_skips_waiting_prompts_that_would_need_chunking() -> None:
    sched = make()
    first = req("first", 4 * CHUNK, 2, seed=1)
    sched.add_request(first)
    step(sched)
    assert sched.chunked_req is first
    second = req("second", 3 * CHUNK, 2, seed=2)  # long: waits until "first" is done
    shorts = [req(f"s{i}", 5, 2, seed=10 + i) for i in range(2)]
    for r in (second, *shorts):
        sched.add_request(r)
    for _ in range(4):
        step(sched)
        # Only one prompt is ever chunked, and the short ones never are.
        assert sched.chunked_req in (first, None)
    assert all(r.output_ids for r in shorts) and not second.output_ids
    drain(sched)
    assert all(r.output_ids == expected(r) for r in (first, second, *shorts))


def test_a_prompt_over_the_per_request_cap_is_refused_naming_the_limit() -> None:
    sched = make(max_prefill_tokens_per_request=50)
    with pytest.raises(ValueError, match="--max-prefill-tokens-per-request 50"):
        sched.add_request(req("big", 51, 2, seed=3))
    with pytest.raises(ValueError, match="--max-prefill-tokens-per-request 50"):
        sched.validator.check_raw_request(None, [2] * 51, SamplingParams(max_new_tokens=2), top_logprobs_num=0,
                                          logprob_start_len=-1)
    ok = req("ok", 50, 2, seed=4)
    sched.add_request(ok)  # the server keeps serving: one under the cap runs
    drain(sched)
    assert ok.output_ids == expected(ok)
    with pytest.raises(ValueError, match="--max-prefill-tokens-per-request"):
        ServerArgs(max_prefill_tokens_per_request=0)


def test_under_priority_scheduling_only_as_urgent_requests_share_a_chunked_prompts_rounds() -> None:
    sched = make(enable_priority_scheduling=True)
    urgent_long = req("urgent", 6 * CHUNK, 2, seed=5)
    urgent_long.priority = 10
    sched.add_request(urgent_long)
    step(sched)
    assert sched.chunked_req is urgent_long
    low, peer = req("low", 5, 2, seed=6), req("peer", 5, 2, seed=7)
    low.priority, peer.priority = 0, 10
    sched.add_request(low)
    sched.add_request(peer)
    for _ in range(3):
        step(sched)
    assert peer.output_ids and not low.output_ids  # the peer shared a round; the less urgent one waits
    drain(sched)
    assert all(r.output_ids == expected(r) for r in (urgent_long, low, peer))
