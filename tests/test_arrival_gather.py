"""An idle scheduler holds its prefill briefly for a turn's requests (managers/arrival_gather.py):
when k > 1 requests finished together, the first to come back waits up to --gather-arrivals-ms for the
other k - 1, so they prefill as one batch. Checked on the scheduler with the fake runner and a clock
the test moves, and through the simulator's replay."""

from __future__ import annotations

import pytest

from fake_runner import FakeRunner
from sgl_lite.runtime.managers.arrival_gather import EXPECT_S, ArrivalGather
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.server_args import ServerArgs
from test_scheduler import EOS, VOCAB, CharTokenizer, expected, prompt_of, req, run_to_end

WINDOW_MS = 15.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, **args) -> Scheduler:
    args.setdefault("chunked_prefill_size", -1)
    args.setdefault("gather_arrivals_ms", WINDOW_MS)
    runner = FakeRunner(num_slots=4096, max_running_requests=32, context_length=1024, vocab_size=VOCAB)
    return Scheduler(ServerArgs(**args), runner, tokenizer=CharTokenizer(), eos_token_ids=(EOS,), context_length=1024,
                     clock=clock)


def finish_together(sched: Scheduler, n: int) -> None:
    """Run n requests of the same length to the end: they finish in the same decode step."""
    for i in range(n):
        sched.add_request(req(f"first{i}", prompt_of(i, 12), max_new=4, ignore_eos=True))
    done = run_to_end(sched)
    assert len(done) == n and not sched.has_work()


def step_prefills(sched: Scheduler) -> int:
    """Run one step; return how many requests it prefilled (started running)."""
    before = set(sched.running)
    sched.step()
    sched.check_invariant()
    return len([r for r in sched.running if r not in before])


def test_the_first_arrival_waits_for_the_rest_of_the_turn_and_they_prefill_together() -> None:
    clock = Clock()
    sched = make(clock)
    finish_together(sched, 3)
    assert sched.gather_remaining() == 0.0  # nothing held yet (the server loop asks this while idle)
    clock.now += 0.5  # the clients' round trip: the window opens at the first arrival, not at the drain
    turn = [req(f"next{i}", prompt_of(10 + i, 9)) for i in range(3)]
    sched.add_request(turn[0])
    assert not sched.has_ready_work() and sched.has_work()
    assert step_prefills(sched) == 0
    assert sched.gather_remaining() == pytest.approx(WINDOW_MS / 1000)
    clock.now += 0.005
    sched.add_request(turn[1])
    assert step_prefills(sched) == 0
    sched.add_request(turn[2])
    assert sched.has_ready_work()
    assert step_prefills(sched) == 3
    assert sched.gather_remaining() == 0.0
    done = run_to_end(sched)
    assert all(done[r.rid].output_ids == expected(r) for r in turn)


def test_when_the_window_closes_the_arrivals_so_far_are_prefilled() -> None:
    clock = Clock()
    sched = make(clock)
    finish_together(sched, 4)
    sched.add_request(req("lone", prompt_of(20, 9)))
    assert step_prefills(sched) == 0
    clock.now += WINDOW_MS / 1000
    assert sched.has_ready_work()
    assert step_prefills(sched) == 1
    # the gathering is over: a later arrival is prefilled at once (batched with the decode as usual)
    sched.add_request(req("later", prompt_of(21, 9)))
    assert step_prefills(sched) == 1
    run_to_end(sched)


@pytest.mark.parametrize("case", ["one finished", "disabled", "expectation lapsed"])
def test_no_wait_where_no_turn_is_expected(case: str) -> None:
    clock = Clock()
    sched = make(clock, **({"gather_arrivals_ms": 0} if case == "disabled" else {}))
    finish_together(sched, 1 if case == "one finished" else 3)
    if case == "expectation lapsed":
        clock.now += EXPECT_S
    sched.add_request(req("next", prompt_of(30, 9)))
    assert sched.has_ready_work()
    assert step_prefills(sched) == 1
    run_to_end(sched)


def test_a_drain_with_requests_still_queued_expects_nothing() -> None:
    clock = Clock()
    sched = make(clock, max_running_requests=2)
    for i in range(3):  # two finish together while the third waits for a row: no herd to wait for
        sched.add_request(req(f"r{i}", prompt_of(i, 12), max_new=4, ignore_eos=True))
    finished: list[str] = []
    while len(finished) < 2:
        finished += [r.rid for r in sched.step() if r.finished]
        assert sched.gather.expected == 0
    assert finished == ["r0", "r1"] and sched.num_waiting() + len(sched.running) == 1
    run_to_end(sched)
    assert sched.gather.expected == 0  # the third finished alone


def test_gather_state_machine() -> None:
    g = ArrivalGather(window=0.01)
    g.on_drain(1, now=0.0)
    assert not g.holds(1, now=0.0)  # one session: its own turn is the one expected
    g.on_drain(3, now=0.0)
    assert not g.holds(0, now=0.5)  # nothing waiting: nothing held (the round trip)
    assert g.holds(1, now=0.5) and g.remaining(0.5) == pytest.approx(0.01)
    assert g.holds(2, now=0.505)
    assert not g.holds(2, now=0.51)  # the window closed
    assert not g.holds(1, now=0.52) and g.expected == 0  # and stays closed
    g.on_drain(3, now=1.0)
    assert not g.holds(3, now=1.001)  # all arrived at once


def test_bad_window_is_rejected() -> None:
    with pytest.raises(ValueError, match="--gather-arrivals-ms"):
        ServerArgs(gather_arrivals_ms=-1)
    with pytest.raises(ValueError, match="--gather-arrivals-ms"):
        ServerArgs(gather_arrivals_ms=float("nan"))


def test_the_simulator_lets_a_held_turn_wait_out_the_window() -> None:
    from sgl_lite.sim.cost_model import CostModel
    from sgl_lite.sim.simulator import simulate
    from sgl_lite.sim.trace import SimSession

    # Three sessions finish their first turns in the same step; only session 0 has a second turn, so
    # the scheduler expects three and holds it for the whole window, in virtual time.
    sessions = [SimSession(i, 0.0, prompt_of(40 + i, 20), [prompt_of(50, 6)] if i == 0 else [], output_len=4) for i in range(3)]
    result = simulate(sessions, ServerArgs(gather_arrivals_ms=WINDOW_MS), CostModel.default(), think_time_s=0.1)
    second = next(r for r in result.requests if r.rid == "s0-t1")
    assert second.admitted - second.arrival == pytest.approx(WINDOW_MS / 1000, abs=1e-5)
    plain = simulate(sessions, ServerArgs(gather_arrivals_ms=0), CostModel.default(), think_time_s=0.1)
    assert next(r for r in plain.requests if r.rid == "s0-t1").admitted == pytest.approx(second.arrival)
