"""The incremental waiting index orders exactly like the straightforward `SchedulePolicy.order`.

Random trees and queues over a 3-letter alphabet (so prefixes are shared and edges split often):
inserts, matches (which split edges), evictions, resets, arrivals, departures and re-arrivals with
an old arrival time (as retraction does); after every operation the lazy order must equal the
reference's and every attachment must equal a fresh walk.
"""

from __future__ import annotations

import random

import pytest
import torch

from sgl_lite.runtime.managers.policy import SchedulePolicy
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.radix_cache import RadixCache
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.sim.cost_model import VirtualClock

ALPHABET = (2, 3, 4)


def random_key(rng: random.Random, known: list[list[int]], max_len: int = 12) -> list[int]:
    base = list(rng.choice(known))[: rng.randrange(0, max_len)] if known and rng.random() < 0.8 else []
    return base + [rng.choice(ALPHABET) for _ in range(rng.randrange(1, 6))]


def run_trial(seed: int, policy: str, steps: int = 150) -> None:
    rng = random.Random(seed)
    clock = VirtualClock()
    check, deprioritize = rng.choice((0, 2, 4, 32)), rng.choice((0, 1, 2, 3, 32))
    max_wait = rng.choice((None, 5.0, 20.0))
    common = dict(schedule_policy=policy, in_batch_prefix_caching_check_threshold=check,
                  in_batch_prefix_caching_deprioritize_threshold=deprioritize, lpm_max_wait=max_wait)
    tree = RadixCache(None, None)
    incremental = SchedulePolicy(ServerArgs(**common), tree, clock)
    reference = SchedulePolicy(ServerArgs(disable_incremental_ordering=True, **common), tree, clock)
    assert incremental.index is not None and reference.index is None
    known: list[list[int]] = []
    waiting: dict[Req, None] = {}
    departed: list[Req] = []
    count = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.25:
            key = random_key(rng, known)
            tree.insert(key, torch.arange(1, len(key) + 1))
            known.append(key)
        elif op < 0.35:
            tree.match_prefix(random_key(rng, known))
        elif op < 0.45:
            tree.evict(rng.randrange(1, 8))
        elif op < 0.47:
            tree.reset()
        elif op < 0.75:
            count += 1
            prompt = random_key(rng, known) + [rng.choice(ALPHABET)]
            req = Req(f"r{count}", prompt, SamplingParams(max_new_tokens=4), arrival_time=clock.now + rng.random() * 0.01)
            if rng.random() < 0.1:
                req.return_logprob, req.logprob_start_len = True, rng.randrange(0, len(prompt) + 1)
            waiting[req] = None
            incremental.on_enqueue(req)
        elif op < 0.9 and waiting:
            req = rng.choice(list(waiting))
            del waiting[req]
            incremental.on_dequeue(req)
            departed.append(req)
        elif departed:
            req = departed.pop(rng.randrange(len(departed)))  # back with its old arrival time
            waiting[req] = None
            incremental.on_enqueue(req)
        clock.now += rng.random() * 2
        queue = list(waiting)
        # The incremental order first: the reference's matches split every edge a match ends in.
        got, _ = incremental.candidates(queue, len(queue))
        expected = queue[:]
        reference.order(expected)
        assert [r.rid for r in got] == [r.rid for r in expected], f"seed {seed}"
        incremental.index.check()
        tree.check_integrity()


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_incremental_order_equals_reference(policy: str) -> None:
    for seed in range(40):
        run_trial(seed, policy)


def test_lazy_head_is_a_prefix_of_the_full_order() -> None:
    tree = RadixCache(None, None)
    clock = VirtualClock()
    policy = SchedulePolicy(ServerArgs(schedule_policy="lpm"), tree, clock)
    rng = random.Random(5)
    known = [random_key(rng, []) for _ in range(10)]
    for key in known:
        tree.insert(key, torch.arange(1, len(key) + 1))
    reqs = [Req(f"r{i}", random_key(rng, known) + [2], SamplingParams(max_new_tokens=1), arrival_time=float(i)) for i in range(200)]
    for r in reqs:
        policy.on_enqueue(r)
    full, _ = policy.candidates(reqs, len(reqs))
    head, _ = policy.candidates(reqs, 7)
    assert head == full[:7] and len(full) == 200


def test_fallback_threshold_still_applies_to_the_index() -> None:
    tree = RadixCache(None, None)
    tree.insert([9] * 20, torch.arange(1, 21))
    policy = SchedulePolicy(ServerArgs(schedule_policy="lpm", lpm_fallback_threshold=2), tree, VirtualClock())
    cold = [Req(f"c{i}", [i + 30, 1, 2], SamplingParams(max_new_tokens=1), arrival_time=float(i)) for i in range(2)]
    hot = Req("hot", [9] * 20 + [1], SamplingParams(max_new_tokens=1), arrival_time=5.0)
    for r in cold + [hot]:
        policy.on_enqueue(r)
    assert [r.rid for r in policy.candidates([], 3)[0]] == ["c0", "c1", "hot"]  # 3 > 2: fcfs
    policy.on_dequeue(cold[0])
    assert [r.rid for r in policy.candidates([], 3)[0]] == ["hot", "c1"]


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_scheduler_runs_the_same_batches_with_and_without_the_index(policy: str) -> None:
    from fake_runner import FakeRunner

    from sgl_lite.runtime.managers.scheduler import Scheduler

    def run(incremental: bool) -> list:
        rng = random.Random(11)
        runner = FakeRunner(num_slots=100_000, max_running_requests=6, context_length=256, vocab_size=64)
        args = ServerArgs(schedule_policy=policy, disable_incremental_ordering=not incremental,
                          chunked_prefill_size=24, max_running_requests=6)
        sched = Scheduler(args, runner, eos_token_ids=(), context_length=256)
        prefixes = [[rng.randrange(2, 64) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
        for i in range(120):
            prompt = rng.choice(prefixes) + [rng.randrange(2, 64) for _ in range(rng.randrange(1, 12))]
            sched.add_request(Req(f"q{i}", prompt, SamplingParams(max_new_tokens=rng.randrange(1, 6), ignore_eos=True),
                                  arrival_time=float(i)))
            if rng.random() < 0.5:
                sched.step()
        while sched.has_work():
            sched.step()
        sched.check_invariant()
        return [(r.is_decode, r.rids, r.prefix_lens, r.extend_lens) for r in runner.records]

    assert run(incremental=True) == run(incremental=False)
