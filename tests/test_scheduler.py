"""Scheduler behaviour with the deterministic fake runner: outputs, budgets, retraction, aborts
(priority and preemption: test_scheduler_priority.py).

Every scheduler built here is checked by `check_invariant` after each step of `run_to_end` and once
more after the test (autouse fixture).
"""

from __future__ import annotations

import random

import pytest
from fake_runner import FakeRunner, reference_output

from sgl_lite.runtime.managers.request import FinishKind, Req
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server_args import ServerArgs

VOCAB = 64
EOS = 1
_built: list[Scheduler] = []


@pytest.fixture(autouse=True)
def _invariant_after_each_test():
    _built.clear()
    yield
    for sched in _built:
        sched.check_invariant()


class CharTokenizer:
    """Token t decodes to one letter, so stop strings are predictable."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def make(slots: int = 4096, rows: int = 32, context: int = 1024, eos: tuple[int, ...] = (EOS,), **args) -> tuple[Scheduler, FakeRunner]:
    args.setdefault("chunked_prefill_size", -1)
    runner = FakeRunner(num_slots=slots, max_running_requests=rows, context_length=context, vocab_size=VOCAB)
    sched = Scheduler(ServerArgs(**args), runner, tokenizer=CharTokenizer(), eos_token_ids=eos, context_length=context)
    _built.append(sched)
    return sched, runner


def req(rid: str, prompt: list[int], max_new: int = 8, priority: int | None = None, **params) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0, **params), priority=priority)


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def run_to_end(sched: Scheduler, max_steps: int = 20000) -> dict[str, Req]:
    done: dict[str, Req] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return done
        for r in sched.step():
            if r.finished:
                assert r.rid not in done, f"{r.rid} reported finished twice"
                done[r.rid] = r
        sched.check_invariant()
    raise AssertionError("scheduler did not drain")


def expected(r: Req, stop: set[int] = frozenset({EOS})) -> list[int]:
    return reference_output(r.input_ids, r.sampling_params.max_new_tokens, VOCAB, stop)


# ---------------------------------------------------------------- outputs and the cache


def test_outputs_match_reference_and_second_wave_hits_cache() -> None:
    sched, _ = make()
    shared = prompt_of(1, 40)
    first = [req(f"a{i}", shared + prompt_of(10 + i, 5), max_new=12) for i in range(4)]
    for r in first:
        sched.add_request(r)
    done = run_to_end(sched)
    assert all(done[r.rid].output_ids == expected(r) for r in first)
    second = [req(f"b{i}", shared + prompt_of(10 + i, 5) + [3, 4], max_new=12) for i in range(4)]
    for r in second:
        sched.add_request(r)
    run_to_end(sched)
    assert all(r.output_ids == expected(r) for r in second)
    assert all(r.cached_tokens >= 45 for r in second)
    assert sched.stats()["cached_tokens_total"] > 0


def test_prefill_only_request_caches_its_prompt() -> None:
    sched, runner = make()
    prompt = prompt_of(2, 30)
    hint = req("hint", prompt, max_new=0)
    sched.add_request(hint)
    run_to_end(sched)
    assert hint.finished_reason.kind is FinishKind.LENGTH and hint.output_ids == []
    assert not any(rec.is_decode for rec in runner.records if "hint" in rec.rids)
    follow = req("follow", prompt + [5], max_new=4)
    sched.add_request(follow)
    run_to_end(sched)
    assert follow.cached_tokens == 30 and follow.output_ids == expected(follow)


def test_logprob_start_len_limits_the_prefix_match() -> None:
    sched, _ = make()
    prompt = prompt_of(3, 20)
    sched.add_request(req("warm", prompt, max_new=2))
    run_to_end(sched)
    cold_sched, _ = make()
    results = []
    for s in (sched, cold_sched):
        r = req("lp", prompt, max_new=3)
        r.return_logprob, r.logprob_start_len = True, 6
        s.add_request(r)
        run_to_end(s)
        results.append(r)
    warm, cold = results
    assert warm.cached_tokens == 5  # at most logprob_start_len - 1
    assert len(warm.input_token_logprobs) == 20 - 6
    assert warm.input_token_logprobs == cold.input_token_logprobs
    assert warm.output_token_logprobs == cold.output_token_logprobs and warm.output_ids == cold.output_ids


# ---------------------------------------------------------------- chunked prefill


def test_chunked_prefill_uses_configured_chunks_and_matches_unchunked() -> None:
    sched, runner = make(chunked_prefill_size=8)
    long_a, long_b = req("A", prompt_of(4, 30), max_new=6), req("B", prompt_of(5, 19), max_new=6)
    sched.add_request(long_a)
    sched.add_request(long_b)
    run_to_end(sched)
    prefills = [rec for rec in runner.records if not rec.is_decode]
    chunks_a = [rec.extend_lens[rec.rids.index("A")] for rec in prefills if "A" in rec.rids]
    chunks_b = [rec.extend_lens[rec.rids.index("B")] for rec in prefills if "B" in rec.rids]
    assert chunks_a == [8, 8, 8, 6]
    assert sum(chunks_b) == 19 and max(chunks_b) <= 8
    for rec in prefills:
        assert sum(rec.extend_lens) <= 8
    # The in-flight chunk goes first in the next prefill round.
    a_rounds = [rec for rec in prefills if "A" in rec.rids]
    assert all(rec.rids[0] == "A" for rec in a_rounds[1:])
    plain, _ = make()
    copies = [req("A", long_a.input_ids, max_new=6), req("B", long_b.input_ids, max_new=6)]
    for r in copies:
        plain.add_request(r)
    run_to_end(plain)
    assert [long_a.output_ids, long_b.output_ids] == [c.output_ids for c in copies]


def test_only_one_chunked_request_in_flight() -> None:
    sched, runner = make(chunked_prefill_size=10)
    for i in range(4):
        sched.add_request(req(f"L{i}", prompt_of(20 + i, 25), max_new=3))
    in_flight_max = 0
    while sched.has_work():
        sched.step()
        sched.check_invariant()
        in_flight_max = max(in_flight_max, int(sched.chunked_req is not None))
        # Only the chunked request (in neither list) holds a partly computed prompt.
        partial = [r for r in sched.waiting + sched.running if 0 < r.kv_len < r.seq_len - 1]
        assert not partial
    assert in_flight_max == 1


# ---------------------------------------------------------------- stop conditions


def test_eos_stop_token_ids_ignore_eos_and_length() -> None:
    prompt = prompt_of(6, 12)
    free_run = reference_output(prompt, 30, VOCAB)
    eos_tok, stop_tok = free_run[7], free_run[4]
    assume_distinct = free_run.index(eos_tok) == 7 and free_run.index(stop_tok) == 4
    assert assume_distinct, "pick a prompt whose outputs do not repeat early"
    sched, _ = make(eos=(eos_tok,))
    cases = {
        "eos": req("eos", prompt, max_new=30),
        "stop_ids": req("stop_ids", prompt, max_new=30, stop_token_ids=[stop_tok]),
        "ignore": req("ignore", prompt, max_new=30, ignore_eos=True, stop_token_ids=[stop_tok]),
        "length": req("length", prompt, max_new=3),
        "min_new": req("min_new", prompt, max_new=30, min_new_tokens=9, stop_token_ids=[stop_tok]),
    }
    for r in cases.values():
        sched.add_request(r)
    run_to_end(sched)
    assert cases["eos"].output_ids == free_run[:8]
    assert cases["eos"].finished_reason.to_json() == {"type": "stop", "matched": eos_tok}
    assert cases["stop_ids"].output_ids == free_run[:5]
    assert cases["stop_ids"].finished_reason.matched == stop_tok
    assert cases["ignore"].output_ids == free_run and cases["ignore"].finished_reason.kind is FinishKind.LENGTH
    assert cases["length"].output_ids == free_run[:3] and cases["length"].finished_reason.to_json() == {"type": "length"}
    # min_new_tokens defers stop checks (the fake runner does not mask, the checker must wait).
    later = [i for i in range(8, 30) if free_run[i] in (eos_tok, stop_tok)]
    assert cases["min_new"].output_ids == free_run[: later[0] + 1 if later else 30]


def test_stop_string_matches_decoded_tail() -> None:
    prompt = prompt_of(7, 10)
    free_run = reference_output(prompt, 30, VOCAB)
    text = CharTokenizer().decode(free_run)
    stop = text[5:8]
    first = text.find(stop)
    sched, _ = make(eos=())
    r = req("s", prompt, max_new=30, stop=["zzzzzzzz", stop])
    sched.add_request(r)
    run_to_end(sched)
    assert r.finished_reason.to_json() == {"type": "stop", "matched": stop}
    assert len(r.output_ids) == first + len(stop)


def test_context_length_and_bad_input_rejected_without_leaks() -> None:
    sched, _ = make(context=64, slots=48)
    with pytest.raises(ValueError, match="context length"):
        sched.add_request(req("long", prompt_of(8, 60), max_new=8))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(req("empty", [], max_new=8))
    with pytest.raises(ValueError, match="vocabulary"):
        sched.add_request(req("oov", [2, VOCAB + 5], max_new=8))
    with pytest.raises(ValueError, match="KV cache pool"):
        sched.add_request(req("pool", prompt_of(9, 50), max_new=1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.add_request(req("neg", [2, 3], max_new=-1))
    assert not sched.has_work()
    ok = req("ok", prompt_of(10, 20), max_new=5)
    sched.add_request(ok)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("ok", [2, 3]))
    run_to_end(sched)
    assert ok.output_ids == expected(ok)


# ---------------------------------------------------------------- aborts


def test_abort_in_every_state() -> None:
    sched, _ = make(chunked_prefill_size=8, max_running_requests=2)
    running = req("running", prompt_of(11, 5), max_new=50, ignore_eos=True)
    chunked = req("chunked", prompt_of(12, 40), max_new=5)
    sched.add_request(running)
    sched.step()  # running prefilled
    sched.add_request(chunked)
    sched.step()  # first chunk of "chunked"
    assert sched.chunked_req is chunked and running in sched.running
    waiting = req("waiting", prompt_of(13, 5), max_new=5)
    sched.add_request(waiting)
    bystander = req("bystander", prompt_of(14, 6), max_new=5)
    sched.add_request(bystander)
    assert sched.abort_request("waiting") and sched.abort_request("chunked") and sched.abort_request("running")
    assert not sched.abort_request("waiting") and not sched.abort_request("nope")
    sched.check_invariant()
    done = run_to_end(sched)
    for r in (waiting, chunked, running):
        assert done[r.rid].finished_reason.kind is FinishKind.ABORT
    assert bystander.output_ids == expected(bystander)


# ---------------------------------------------------------------- memory pressure


def test_retraction_under_tiny_pool_keeps_outputs() -> None:
    sched, _ = make(slots=90, max_running_requests=8)
    reqs = [req(f"r{i}", prompt_of(30 + i, 10), max_new=40, ignore_eos=True) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    ratios = []
    while sched.has_work():
        sched.step()
        sched.check_invariant()
        ratios.append(sched.new_token_ratio)
    assert sched.num_retractions > 0
    assert any(r.num_retractions > 0 for r in reqs)
    assert all(r.output_ids == reference_output(r.input_ids, 40, VOCAB) for r in reqs)
    assert max(ratios) > 0.7  # re-estimated upwards after a retraction (1 - decoded share)


def test_retract_picks_fewest_decoded_then_longest_prompt() -> None:
    # A tiny conservativeness makes admission ignore future outputs, so decoding runs out of slots.
    sched, _ = make(slots=60, max_running_requests=8, schedule_conservativeness=0.01)
    old = req("old", prompt_of(40, 8), max_new=30, ignore_eos=True)
    sched.add_request(old)
    for _ in range(6):
        sched.step()
    young_short = req("young_short", prompt_of(41, 5), max_new=30, ignore_eos=True)
    young_long = req("young_long", prompt_of(42, 9), max_new=30, ignore_eos=True)
    sched.add_request(young_short)
    sched.add_request(young_long)
    while sched.num_retractions == 0 and sched.has_work():
        sched.step()
    assert young_long.num_retractions == 1 and young_short.num_retractions == 0 and old.num_retractions == 0
    run_to_end(sched)
    assert all(r.output_ids == reference_output(r.input_ids, 30, VOCAB) for r in (old, young_short, young_long))


def test_new_token_ratio_decays_and_resets() -> None:
    sched, _ = make(schedule_conservativeness=1.0)
    sched.add_request(req("r", prompt_of(50, 5), max_new=20, ignore_eos=True))
    sched.step()
    sched.step()
    sched.step()
    assert sched.new_token_ratio == pytest.approx(0.7 - 2 * 0.001)
    run_to_end(sched)
    assert sched.new_token_ratio == pytest.approx(0.7)
    halved, _ = make(schedule_conservativeness=0.5)
    assert halved.new_token_ratio == pytest.approx(0.35) and halved.min_new_token_ratio == pytest.approx(0.05)


def test_admission_reserves_output_tokens() -> None:
    # Each request needs 10 prompt + 50 reserved output tokens; 100 slots admit one at a time.
    sched, runner = make(slots=100)
    for i in range(3):
        sched.add_request(req(f"r{i}", prompt_of(60 + i, 10), max_new=50, ignore_eos=True))
    sched.step()
    assert len(sched.running) == 1 and len(sched.waiting) == 2
    run_to_end(sched)


# ---------------------------------------------------------------- cache flush and stats


def test_flush_cache_only_when_idle() -> None:
    sched, _ = make()
    sched.add_request(req("a", prompt_of(93, 10), max_new=3))
    assert not sched.flush_cache()
    run_to_end(sched)
    assert sched.kv.tree_cache.evictable_size() > 0
    assert sched.flush_cache()
    assert sched.kv.tree_cache.evictable_size() == 0 and sched.kv.allocator.available_size == sched.num_slots
    stats = sched.stats()
    for key in ("num_waiting", "num_running", "slots_total", "slots_free", "slots_evictable", "slots_protected",
                "cached_tokens_total", "prompt_tokens_total", "cache_hit_rate", "num_retractions",
                "num_preemptions", "new_token_ratio"):
        assert key in stats
