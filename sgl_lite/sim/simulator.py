"""Replay sessions through the real Scheduler, RadixCache and policies in virtual time.

Only the model is replaced (cost_model.CostModelRunner). The loop (`replay`, shared with
scripts/sim_vs_runtime.py, which runs it on the real runtime in real time): requests whose arrival
time has come are added; one scheduler step runs (in simulation its forward advances the clock);
finished turns schedule their session's next turn at the finish time; when nothing is runnable,
time passes to the next arrival. Same sessions, args and cost model => same result.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_lite.runtime.managers.request import FinishKind, Req
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.sim.cost_model import CostModel, CostModelRunner, VirtualClock
from sgl_lite.sim.trace import SimSession

# What "priority" means in the policy list: fcfs ordering under priority scheduling (with preemption).
POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority")
DEFAULT_NUM_SLOTS = 65536
DEFAULT_MAX_RUNNING = 64
DEFAULT_CONTEXT = 8192


def policy_args(base: ServerArgs, policy: str) -> ServerArgs:
    if policy == "priority":
        return base.replace(schedule_policy="fcfs", enable_priority_scheduling=True)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    return base.replace(schedule_policy=policy)


@dataclass
class RequestResult:
    rid: str
    priority: int
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    aborted: bool = False


@dataclass
class SimResult:
    policy: str
    requests: list[RequestResult]
    makespan_s: float
    busy_s: float
    stats: dict[str, Any]
    summary: dict[str, Any] = field(default_factory=dict)


def simulate(sessions: list[SimSession], args: ServerArgs, cost: CostModel, *, policy: str = "",
             vocab_size: int = 49152, context_length: int = DEFAULT_CONTEXT, think_time_s: float = 0.0,
             max_steps: int = 10_000_000) -> SimResult:
    """Run every session to the end; `args` is used as given (see policy_args for the six policies)."""
    clock = VirtualClock(min((s.arrival for s in sessions), default=0.0))
    num_slots = args.max_total_tokens or DEFAULT_NUM_SLOTS
    runner = CostModelRunner(cost, clock, num_slots, args.max_running_requests or DEFAULT_MAX_RUNNING,
                             context_length, vocab_size)
    sched = Scheduler(args, runner, eos_token_ids=(), context_length=context_length, clock=clock)

    def jump(t: float) -> None:
        clock.now = max(clock.now, t)

    start = clock.now
    results = replay(sessions, sched, clock, jump, think_time_s, max_steps)
    for res in results:
        res.admitted = runner.first_scheduled.get(res.rid)
    out = SimResult(policy or args.schedule_policy, results, clock.now - start, runner.busy_s, sched.stats())
    out.summary = summarize(out)
    return out


def replay(sessions: list[SimSession], sched: Scheduler, now: Callable[[], float], wait_until: Callable[[float], None],
           think_time_s: float = 0.0, max_steps: int = 10_000_000) -> list[RequestResult]:
    """Drive `sched` through the sessions on its clock `now` (arrival times are on that clock);
    `wait_until(t)` lets time pass until t when nothing can run (a jump, or a sleep in real time)."""
    # (arrival, order, session, turn, prompt); order keeps equal arrivals in session order.
    arrivals: list[tuple[float, int, SimSession, int, list[int]]] = []
    for s in sessions:
        heapq.heappush(arrivals, (s.arrival, len(arrivals), s, 0, s.first_prompt))
    order = len(arrivals)
    results: dict[str, RequestResult] = {}
    live: dict[str, tuple[SimSession, int]] = {}
    idle_steps = 0
    for _ in range(max_steps):
        if not sched.has_work():
            if not arrivals:
                break
            wait_until(arrivals[0][0])
        while arrivals and arrivals[0][0] <= now():
            t, _, session, turn, prompt = heapq.heappop(arrivals)
            rid = f"s{session.session_id}-t{turn}"
            priority = session.priority if sched.args.enable_priority_scheduling else None
            req = Req(rid, prompt, SamplingParams(max_new_tokens=session.output_len, temperature=0.0, ignore_eos=True),
                      priority=priority, arrival_time=t)
            sched.add_request(req)
            results[rid] = RequestResult(rid, session.priority, t, prompt_tokens=len(prompt))
            live[rid] = (session, turn)
        steps_before = sched.num_forward_steps
        for req in sched.step():
            if not req.finished or req.rid not in live:
                continue
            session, turn = live.pop(req.rid)
            res = results[req.rid]
            res.finished, res.first_token = now(), req.first_token_time
            res.cached_tokens, res.output_tokens = req.cached_tokens, len(req.output_ids)
            res.aborted = req.finished_reason.kind is FinishKind.ABORT
            if not res.aborted and turn + 1 < session.num_turns:
                prompt = [*req.input_ids, *req.output_ids, *session.appendices[turn]]
                heapq.heappush(arrivals, (now() + think_time_s, order, session, turn + 1, prompt))
                order += 1
        if sched.num_forward_steps == steps_before and sched.has_work():
            # Nothing ran (finishes reported outside a forward, say): time only moves with arrivals.
            idle_steps += 1
            if arrivals:
                wait_until(arrivals[0][0])
            elif idle_steps > 3:
                raise RuntimeError(f"the scheduler made no progress with {sched.num_waiting()} waiting")
        else:
            idle_steps = 0
    else:
        raise RuntimeError(f"replay did not finish within {max_steps} steps")
    sched.check_invariant()
    return list(results.values())


def _percentile(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def summarize(result: SimResult) -> dict[str, Any]:
    done = [r for r in result.requests if r.finished is not None and not r.aborted]
    ttft = [r.first_token - r.arrival for r in done if r.first_token is not None]
    waits: dict[int, list[float]] = {}
    for r in result.requests:
        if r.admitted is not None:
            waits.setdefault(r.priority, []).append(r.admitted - r.arrival)
    stats = result.stats
    span = result.makespan_s
    return {
        "policy": result.policy,
        "requests": len(result.requests),
        "completed": len(done),
        "cache_hit_rate": stats["cache_hit_rate"],
        "makespan_s": span,
        "output_tokens_per_s": sum(r.output_tokens for r in done) / span if span > 0 else None,
        "requests_per_s": len(done) / span if span > 0 else None,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "queue_wait_p99_s_by_priority": {str(p): _percentile(w, 99) for p, w in sorted(waits.items())},
        "queue_wait_max_s": max((max(w) for w in waits.values()), default=None),
        "preemptions": stats["num_preemptions"],
        "retractions": stats["num_retractions"],
        "forward_steps": stats["num_forward_steps"],
        "busy_fraction": result.busy_s / span if span > 0 else None,
    }
