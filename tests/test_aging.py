"""Starvation bounds: --priority-aging-rate for priority scheduling, --lpm-max-wait for lpm / dfs-weight.

A virtual clock (the Scheduler's `clock`) advances DT seconds per step; a new more-favoured request
arrives every step, so without the flag the victim waits as long as the stream lasts, and with it
the victim is served by the documented bound: it is ordered before every request that arrived more
than Delta / rate (or max-wait) seconds after it, so only what arrived before that can go first.
"""

from __future__ import annotations

import random

import pytest
from fake_runner import FakeRunner, reference_output

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.sim.cost_model import VirtualClock

VOCAB = 64
DT = 0.1  # virtual seconds per step
STEPS = 400


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def run_stream(args: ServerArgs, victim_prompt: list[int], victim_priority: int | None,
               stream_prompt, stream_priority: int | None) -> tuple[Req, list[Req], Scheduler, FakeRunner]:
    """Step the scheduler STEPS times; one stream request arrives per step, the victim at step 5."""
    clock = VirtualClock()
    runner = FakeRunner(num_slots=4096, max_running_requests=1, context_length=256, vocab_size=VOCAB)
    sched = Scheduler(args, runner, eos_token_ids=(), context_length=256, clock=clock)
    victim: Req | None = None
    stream: list[Req] = []
    for step in range(STEPS):
        clock.now = step * DT
        if step == 5:
            victim = Req("victim", victim_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True),
                         priority=victim_priority, arrival_time=clock.now)
            sched.add_request(victim)
        r = Req(f"s{step}", stream_prompt(step), SamplingParams(max_new_tokens=1, ignore_eos=True),
                priority=stream_priority, arrival_time=clock.now)
        sched.add_request(r)
        stream.append(r)
        sched.step()
        sched.check_invariant()
    assert victim is not None
    return victim, stream, sched, runner


def first_prefill(runner: FakeRunner, rid: str) -> int | None:
    return next((i for i, rec in enumerate(runner.records) if not rec.is_decode and rid in rec.rids), None)


def check_bound(victim: Req, stream: list[Req], runner: FakeRunner, bound_s: float) -> None:
    """No stream request that arrived more than `bound_s` after the victim was admitted before it."""
    victim_at = first_prefill(runner, "victim")
    assert victim_at is not None, "the victim was never admitted"
    for r in stream:
        at = first_prefill(runner, r.rid)
        if r.arrival_time > victim.arrival_time + bound_s + 1e-9 and at is not None:
            assert at >= victim_at, f"{r.rid} (arrived {r.arrival_time:.1f}) went before the victim"
    assert victim.output_ids == reference_output(victim.input_ids, 2, VOCAB)


@pytest.mark.parametrize("low_first", [False, True])
def test_priority_aging_bounds_the_wait_of_a_low_priority_request(low_first: bool) -> None:
    delta, rate = 5, 2.0  # the stream is 5 units more urgent; the victim gains 2 units per second
    sign = -1 if low_first else 1
    base = dict(enable_priority_scheduling=True, schedule_low_priority_values_first=low_first, chunked_prefill_size=-1)
    stream_prompt = lambda step: prompt_of(1000 + step, 6)  # noqa: E731
    # The stream arrives faster than one row serves it: without aging the victim waits for ever.
    victim, stream, sched, _ = run_stream(ServerArgs(**base), prompt_of(1, 6), 0, stream_prompt, sign * delta)
    assert victim.first_token_time is None and victim in sched.waiting
    assert sum(r.finished for r in stream) > 100

    victim, stream, sched, runner = run_stream(ServerArgs(priority_aging_rate=rate, **base), prompt_of(1, 6), 0,
                                               stream_prompt, sign * delta)
    check_bound(victim, stream, runner, delta / rate)
    # What was ahead at the bound: stream requests that arrived within delta / rate of the victim
    # and were still queued; one row serves one request per prefill + decode pair of steps.
    ahead = [r for r in stream if victim.arrival_time <= r.arrival_time <= victim.arrival_time + delta / rate]
    assert victim.first_token_time - victim.arrival_time <= delta / rate + 2 * DT * (len(ahead) + 1) + 1e-9
    assert sched.num_preemptions == 0  # delta is below the preemption threshold: aging alone did it


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
@pytest.mark.parametrize("incremental", [True, False])
def test_lpm_max_wait_bounds_the_wait_of_a_cache_cold_request(policy: str, incremental: bool) -> None:
    hot = prompt_of(7, 40)
    stream_prompt = lambda step: hot + prompt_of(2000 + step, 3)  # noqa: E731
    base = dict(schedule_policy=policy, chunked_prefill_size=-1, disable_incremental_ordering=not incremental)
    victim, stream, sched, _ = run_stream(ServerArgs(**base), prompt_of(3, 6), None, stream_prompt, None)
    assert victim.first_token_time is None and victim in sched.waiting
    max_wait = 3.0
    victim, stream, sched, runner = run_stream(ServerArgs(lpm_max_wait=max_wait, **base), prompt_of(3, 6), None,
                                               stream_prompt, None)
    check_bound(victim, stream, runner, max_wait)
    ahead = [r for r in stream if victim.arrival_time <= r.arrival_time <= victim.arrival_time + max_wait]
    assert victim.first_token_time - victim.arrival_time <= max_wait + 2 * DT * (len(ahead) + 1) + 1e-9
