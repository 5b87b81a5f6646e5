"""The simulator: same cache behaviour as the real scheduler driven directly, exact virtual time, traces, CLI."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from fake_runner import FakeRunner

from sgl_lite.bench.workloads import multiturn_agent, shared_prefix
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.sim.cli import simulate_command
from sgl_lite.sim.cost_model import CostModel
from sgl_lite.sim.simulator import POLICIES, policy_args, simulate
from sgl_lite.sim.trace import DEFAULT_VOCAB, SimSession, from_workload, load_trace

CONTEXT = 2048


def drive_fake_runner(sessions: list[SimSession], args: ServerArgs) -> tuple[float, dict[str, int]]:
    """The real scheduler + the tests' fake runner, driven step by step (no clock): all sessions start
    at once, a finished turn's next turn is queued right after the step that finished it."""
    runner = FakeRunner(num_slots=args.max_total_tokens, max_running_requests=args.max_running_requests,
                        context_length=CONTEXT, vocab_size=DEFAULT_VOCAB.size, record=False)
    sched = Scheduler(args, runner, eos_token_ids=(), context_length=CONTEXT)

    def queue(session: SimSession, turn: int, prompt: list[int]) -> None:
        req = Req(f"s{session.session_id}-t{turn}", prompt,
                  SamplingParams(max_new_tokens=session.output_len, temperature=0.0, ignore_eos=True))
        sched.add_request(req)
        live[req.rid] = (session, turn)

    live: dict[str, tuple[SimSession, int]] = {}
    cached: dict[str, int] = {}
    for s in sessions:
        queue(s, 0, s.first_prompt)
    while sched.has_work():
        for req in sched.step():
            if req.finished:
                session, turn = live.pop(req.rid)
                cached[req.rid] = req.cached_tokens
                if turn + 1 < session.num_turns:
                    queue(session, turn + 1, [*req.input_ids, *req.output_ids, *session.appendices[turn]])
        sched.check_invariant()
    return sched.stats()["cache_hit_rate"], cached


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_simulator_hit_rate_equals_the_scheduler_with_the_fake_runner(policy: str) -> None:
    workload = multiturn_agent(DEFAULT_VOCAB, num_sessions=10, num_turns=3, system_prompt_len=96, task_len=24,
                               obs_len_min=8, obs_len_max=24, output_len=12, seed=3)
    sessions = from_workload(workload, math.inf, seed=3)
    # A pool small enough that eviction and retraction decide part of the hits.
    args = ServerArgs(schedule_policy=policy, max_total_tokens=900, max_running_requests=6, chunked_prefill_size=128)
    sim = simulate(sessions, args, CostModel.default(), context_length=CONTEXT)
    expected_rate, expected_cached = drive_fake_runner(sessions, args)
    assert sim.stats["num_retractions"] + sim.stats["num_forward_steps"] > 0
    assert {r.rid: r.cached_tokens for r in sim.requests} == expected_cached
    assert sim.summary["cache_hit_rate"] == expected_rate
    assert 0.2 < expected_rate < 1.0


def test_virtual_time_follows_the_cost_model() -> None:
    cost = CostModel(0.01, 0.001, (1, 8), (0.002, 0.02))
    session = SimSession(0, arrival=5.0, first_prompt=list(range(3, 103)), output_len=4)
    result = simulate([session], ServerArgs(), cost)
    (req,) = result.requests
    assert req.admitted == pytest.approx(5.0)
    assert req.first_token - req.arrival == pytest.approx(0.01 + 0.001 * 100)
    assert req.finished - req.first_token == pytest.approx(3 * (0.01 + 0.002))
    assert cost.decode_cost(4) == pytest.approx(0.002 + 0.018 * 3 / 7)
    assert cost.decode_cost(16) == pytest.approx(0.02 + 0.018 * 8 / 7)  # extrapolated


def test_simulation_is_deterministic_and_policies_differ_under_contention() -> None:
    workload = shared_prefix(DEFAULT_VOCAB, num_groups=8, prompts_per_group=8, system_prompt_len=256,
                             question_len=20, output_len=8, seed=2)
    sessions = from_workload(workload, request_rate=8.0, seed=2, priorities=(0, 10))
    base = ServerArgs(max_running_requests=4, max_total_tokens=2000)
    runs = {p: simulate(sessions, policy_args(base, p), CostModel.default(), policy=p).summary for p in POLICIES}
    again = simulate(sessions, policy_args(base, "lpm"), CostModel.default(), policy="lpm").summary
    assert again == runs["lpm"]
    assert all(s["completed"] == len(sessions) for s in runs.values())
    assert runs["lpm"]["cache_hit_rate"] > runs["fcfs"]["cache_hit_rate"]
    prio = runs["priority"]["queue_wait_p99_s_by_priority"]
    assert prio["10"] < prio["0"]


def test_trace_prefix_groups_and_errors(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"arrival": 0.0, "prefix_group": 1, "prefix_len": 50, "suffix_len": 5, "output_len": 3},
            {"arrival": 0.5, "prefix_group": 1, "prefix_len": 80, "suffix_len": 5, "output_len": 3, "priority": 4},
            {"arrival": 1.0, "prompt": [5, 6, 7], "output_len": 2}]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    a, b, c = load_trace(trace)
    assert a.first_prompt[:50] == b.first_prompt[:50] and a.first_prompt[50:55] != b.first_prompt[50:55]
    assert b.priority == 4 and c.first_prompt == [5, 6, 7] and len(b.first_prompt) == 85
    trace.write_text(json.dumps({"arrival": 0.0, "prompt": [5], "output_len": -1}))
    with pytest.raises(ValueError, match=r"t.jsonl:1: 'output_len'"):
        load_trace(trace)
    trace.write_text(json.dumps({"arrival": 0.0, "output_len": 2}))
    with pytest.raises(ValueError, match="prefix_group"):
        load_trace(trace)


def test_cli_writes_every_policy(tmp_path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(simulate_command, [
        "--workload", "shared-prefix", "-w", "gsp_num_groups=3", "-w", "gsp_prompts_per_group=4",
        "-w", "gsp_system_prompt_len=64", "-w", "gsp_output_len=4", "-s", "max_running_requests=2",
        "--request-rate", "10", "--out", str(out), "--no-plot"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["results"]] == list(POLICIES)
    assert "| lpm |" in result.output
    bad = CliRunner().invoke(simulate_command, ["-s", "max_running_requests=zero", "--out", str(out)])
    assert bad.exit_code != 0 and "max_running_requests" in bad.output


def test_cli_output_is_reproducible_with_the_random_policy(tmp_path) -> None:
    """--seed seeds the random policy's shuffle too: the same command prints the same table (the docs'
    tables are regenerated from such commands)."""
    args = ["--workload", "shared-prefix", "-w", "gsp_num_groups=6", "-w", "gsp_prompts_per_group=6",
            "-w", "gsp_system_prompt_len=64", "-w", "gsp_output_len=4", "-s", "max_running_requests=2",
            "-s", "max_total_tokens=600", "--request-rate", "20", "--policies", "random", "--no-plot"]
    reports = []
    for run in range(3):
        out = tmp_path / f"sim{run}.json"
        result = CliRunner().invoke(simulate_command, [*args, "--out", str(out)])
        assert result.exit_code == 0, result.output
        reports.append(json.loads(out.read_text())["results"])
    assert reports[0] == reports[1] == reports[2]
