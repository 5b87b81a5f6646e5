"""Fair prefill's chunks sized by the measured prefill rate (managers/prefill_pacing.py): the estimator
on synthetic timings, the scheduler on a fake runner whose forwards advance a virtual clock, and the
tiny model's greedy output chunked either way. Every scheduler built here is checked by
`check_invariant` after each step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fake_runner import FakeRunner, reference_output
from test_fair_prefill import VOCAB, drain, req, step

from sgl_lite.runtime.managers.prefill_pacing import MIN_CHUNK_TOKENS, TARGET_STEP_S, WINDOW, PrefillPacer, PrefillRate
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch, ForwardOutput
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.sim.cost_model import VirtualClock
from sgl_lite.testing.hf_reference import hf_greedy, hf_model

CHUNK = 1024
CAP = 200  # the chunk the measured rate should give: a forward of CAP tokens takes TARGET_STEP_S
SECONDS_PER_TOKEN = TARGET_STEP_S / CAP
LONG = 3000


@dataclass
class TimedRunner(FakeRunner):
    """The fake runner on a slow machine of virtual time: a forward takes SECONDS_PER_TOKEN a token."""

    clock: VirtualClock = field(default_factory=VirtualClock)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self.clock.now += batch.num_tokens * SECONDS_PER_TOKEN
        return super().forward(batch)


def make(**args) -> tuple[Scheduler, TimedRunner]:
    runner = TimedRunner(num_slots=8192, max_running_requests=16, context_length=4096, vocab_size=VOCAB)
    sched = Scheduler(ServerArgs(chunked_prefill_size=CHUNK, **args), runner, eos_token_ids=(1,),
                      context_length=4096, clock=runner.clock)
    return sched, runner


def expected(r: Req) -> list[int]:
    return reference_output(r.input_ids, r.sampling_params.max_new_tokens, VOCAB)


def rounds_with(runner: TimedRunner, rid: str) -> list[tuple[int, int]]:
    """(rid's extend, every prefill row's extend together) of each prefill round that holds `rid`."""
    return [(rec.extend_lens[rec.rids.index(rid)], sum(rec.extend_lens))
            for rec in runner.records if not rec.is_decode and rid in rec.rids]


def with_a_running_chat(**args) -> tuple[Scheduler, TimedRunner, Req]:
    sched, runner = make(**args)
    chat = req("chat", 8, 200, seed=1)
    sched.add_request(chat)
    step(sched)  # prefilled (the first measured forward) and decoding
    assert sched.running == [chat]
    return sched, runner, chat


def long_prompt_chunked_beside_a_chat() -> tuple[Scheduler, TimedRunner, Req, Req]:
    sched, runner, chat = with_a_running_chat()
    long = req("long", LONG, 3, seed=2)
    sched.add_request(long)
    for _ in range(6):
        step(sched)
    return sched, runner, chat, long


# ---------------------------------------------------------------- the scheduler


def test_beside_a_running_request_a_long_prompts_rounds_shrink_to_the_time_budget() -> None:
    sched, runner, chat, long = long_prompt_chunked_beside_a_chat()
    shorts = [req(f"s{i}", 20, 3, seed=10 + i) for i in range(3)]  # they share the long prompt's rounds
    for r in shorts:
        sched.add_request(r)
    drain(sched)
    rounds = rounds_with(runner, "long")
    # No round with the long prompt computes more than the rate does in TARGET_STEP_S (+1: rounding),
    # the chunks that go first get all of it, and the prompt needed that many more rounds.
    assert all(total <= CAP + 1 for _, total in rounds), rounds
    assert max(chunk for chunk, _ in rounds) >= CAP - 1, rounds
    assert len(rounds) >= LONG // (CAP + 1), len(rounds)
    assert all(r.output_ids == expected(r) for r in (chat, long, *shorts))


def test_a_round_that_takes_in_a_short_request_holds_the_chunk_to_its_floor() -> None:
    sched, runner, chat, long = long_prompt_chunked_beside_a_chat()
    assert sched.chunked_req is long
    short = req("short", 20, 3, seed=10)
    sent = runner.clock.now
    sched.add_request(short)
    while not short.output_ids:
        step(sched)
    # The short request's round computes its prompt and at most MIN_CHUNK_TOKENS of the long one, so its
    # first token waits for a decode step and that round, not for a whole paced step of the chunk.
    (chunk, total), = [(ext, tot) for ext, tot in rounds_with(runner, "long") if ext < CAP - 1]
    assert chunk == MIN_CHUNK_TOKENS and total == chunk + 20, (chunk, total)
    assert runner.clock.now - sent <= (1 + 20 + MIN_CHUNK_TOKENS + 1) * SECONDS_PER_TOKEN
    drain(sched)
    assert all(r.output_ids == expected(r) for r in (chat, long, short))


def test_a_lone_long_prompt_keeps_full_chunks() -> None:
    sched, runner = make()
    warm = req("warm", 8, 2, seed=3)
    sched.add_request(warm)
    drain(sched)  # the rate is measured, and nothing else runs or waits
    long = req("long", LONG, 3, seed=2)
    sched.add_request(long)
    drain(sched)
    assert [chunk for chunk, _ in rounds_with(runner, "long")] == [CHUNK, CHUNK, LONG - 2 * CHUNK]
    assert long.output_ids == expected(long)


@pytest.mark.parametrize("flag", ["disable_fair_prefill", "enable_deterministic_inference"])
def test_chunks_keep_the_configured_size_under(flag: str) -> None:
    sched, runner, chat = with_a_running_chat(**{flag: True})
    long = req("long", LONG, 3, seed=2)
    sched.add_request(long)
    drain(sched)
    assert [chunk for chunk, _ in rounds_with(runner, "long")] == [CHUNK, CHUNK, LONG - 2 * CHUNK]
    assert chat.output_ids == expected(chat) and long.output_ids == expected(long)


def test_with_mixed_chunks_the_decode_rows_never_starve_the_chunk() -> None:
    sched, runner = make(enable_mixed_chunk=True)
    chats = [req(f"chat{i}", 8, 120, seed=20 + i) for i in range(12)]
    for r in chats:
        sched.add_request(r)
    step(sched)
    long = req("long", 1500, 3, seed=2)
    sched.add_request(long)
    drain(sched)
    chunks = [chunk for chunk, _ in rounds_with(runner, "long")]
    # Decode rows ride along (12 a round) without counting against the cap: every chunk gets all of it.
    assert all(CAP - 1 <= chunk <= CAP + 1 for chunk in chunks[:-1]), chunks
    assert all(r.output_ids == expected(r) for r in (*chats, long))


# ---------------------------------------------------------------- the estimator


def test_the_rate_ignores_a_stall_and_follows_a_load_change() -> None:
    rate = PrefillRate()
    assert rate.tokens_per_s is None
    for i in range(WINDOW):
        tokens = 100 + 50 * (i % 3)
        rate.record(tokens, tokens / 1000.0 * (10.0 if i == 3 else 1.0))  # one forward stalls 10x
    assert rate.tokens_per_s == pytest.approx(1000.0)
    for _ in range(WINDOW):  # the machine gets 4x slower: the rate follows within WINDOW forwards
        rate.record(120, 120 / 250.0)
    assert rate.tokens_per_s == pytest.approx(250.0)
    rate.record(0, 1.0)
    rate.record(100, 0.0)
    assert rate.tokens_per_s == pytest.approx(250.0)  # empty or untimed forwards are not evidence


def test_the_cap_stays_between_the_floor_and_the_chunk_size() -> None:
    pacer = PrefillPacer(chunk_size=CHUNK)
    assert pacer.chunk_cap(others=True) is None  # nothing measured: the whole chunk budget
    pacer.rate.record(CAP, TARGET_STEP_S)
    assert CAP - 1 <= pacer.chunk_cap(others=True) <= CAP
    assert pacer.chunk_cap(others=False) is None
    pacer.rate.record(1, 100.0)
    pacer.rate.record(1, 100.0)  # a very slow machine
    assert pacer.chunk_cap(others=True) == MIN_CHUNK_TOKENS
    fast = PrefillPacer(chunk_size=CHUNK)
    fast.rate.record(10 * CHUNK, TARGET_STEP_S / 100)
    assert fast.chunk_cap(others=True) == CHUNK


# ---------------------------------------------------------------- the tiny model


def test_tiny_model_greedy_output_is_the_same_chunked_either_way(tiny_llama_dir: Path) -> None:
    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, dtype="float32", device="cpu",
                    chunked_prefill_size=256, log_level="warning")
    try:
        sched = engine.core.scheduler
        chunks: list[int] = []
        forward = sched.runner.forward

        def recording_forward(batch: ForwardBatch) -> ForwardOutput:  # a spy: the runner itself runs
            if not batch.is_decode:
                chunks.extend(n for r, n in zip(batch.reqs, batch.extend_lens) if len(r.input_ids) == 600)
            return forward(batch)

        sched.runner.forward = recording_forward  # type: ignore[method-assign]
        long_prompt = random.Random(5).choices(range(3, 300), k=600)
        params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
        engine.generate(input_ids=[7, 8, 9], sampling_params=params)  # a measured rate
        alone = engine.generate(input_ids=long_prompt, sampling_params=params)["output_ids"]
        assert chunks == [256, 256, 88]
        engine.flush_cache()
        chunks.clear()
        assert sched.prefill_pacer is not None
        sched.prefill_pacer.target_step_s = 0.0  # any measured rate is slow now: the chunks go to the floor
        chat = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
        outs = engine.generate(input_ids=[[5, 6, 7, 8], long_prompt], sampling_params=[chat, params])
        assert max(chunks) <= MIN_CHUNK_TOKENS and len(chunks) >= 600 // MIN_CHUNK_TOKENS, chunks
        assert outs[1]["output_ids"] == alone == hf_greedy(hf_model(tiny_llama_dir), long_prompt, 10)
    finally:
        engine.shutdown()
    sched.check_invariant()
