"""The serving benchmark's workloads, ideal hit rate and report (sgl_lite.bench)."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import math
from pathlib import Path
from typing import AsyncIterator

import pytest

from sgl_lite.bench.backends import GenerationBackend, StreamEvent
from sgl_lite.bench.config import BenchConfig, parse_config
from sgl_lite.bench.driver import arrival_offsets, run_workload
from sgl_lite.bench.metrics import RequestRecord, ideal_cached_tokens, summarize
from sgl_lite.bench.workloads import Vocabulary, multiturn_agent, random_prompts, shared_prefix

VOCAB = Vocabulary(1000, frozenset({0, 1, 2}))


def _agent(seed: int = 7, **overrides: int):
    params = dict(num_sessions=3, num_turns=3, system_prompt_len=40, task_len=10, obs_len_min=3, obs_len_max=9,
                  output_len=5, seed=seed)
    return multiturn_agent(VOCAB, **{**params, **overrides})


def _gsp(seed: int = 7):
    return shared_prefix(VOCAB, num_groups=3, prompts_per_group=4, system_prompt_len=30, question_len=8,
                         output_len=4, seed=seed)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_generators_are_reproducible_with_a_seed() -> None:
    for make in (_agent, _gsp, lambda seed: random_prompts(VOCAB, num_prompts=5, input_len=20, output_len=3, seed=seed)):
        a, b, c = make(seed=3), make(seed=3), make(seed=4)
        assert a == b
        assert a != c


def test_prompts_avoid_special_tokens_and_stay_in_vocab() -> None:
    ids = [t for s in _agent().sessions for t in s.first_prompt + [x for obs in s.appendices for x in obs]]
    assert min(ids) >= 3 and max(ids) < VOCAB.size


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    workload = _gsp()
    assert len(workload.sessions) == 12
    by_group: dict[int, list[list[int]]] = {}
    for s in workload.sessions:
        assert s.num_turns == 1 and len(s.first_prompt) == 38
        by_group.setdefault(s.group, []).append(s.first_prompt)
    assert sorted(len(v) for v in by_group.values()) == [4, 4, 4]
    for prompts in by_group.values():
        assert len({tuple(p[:30]) for p in prompts}) == 1
        assert len({tuple(p[30:]) for p in prompts}) == len(prompts)
    system_prompts = {tuple(prompts[0][:30]) for prompts in by_group.values()}
    assert len(system_prompts) == 3
    # Arrivals are interleaved across groups, not group-major.
    groups_in_order = [s.group for s in workload.sessions]
    assert groups_in_order != sorted(groups_in_order)


def test_ideal_hit_rate_matches_hand_computed_example() -> None:
    requests = [
        ([1, 2, 3, 4], [9, 9]),  # nothing before it: 0
        ([1, 2, 3, 5, 6], [7]),  # shares [1, 2, 3] with the first prompt: 3
        ([1, 2, 3, 4, 9, 9, 8], [0]),  # extends request 1's prompt + output: 6
        ([1, 2, 3, 5], [1]),  # whole prompt seen before, but the last token must be computed: 3
        ([4, 4], [4]),  # nothing shared: 0
    ]
    assert ideal_cached_tokens(requests) == [0, 3, 6, 3, 0]
    records = []
    for i, (prompt, output) in enumerate(requests):
        record = RequestRecord(i, 0, 0, prompt, send_time=float(i), output_ids=output, chunk_times=[i + 0.5],
                               chunk_sizes=[len(output)], finish_time=i + 1.0, prompt_tokens=len(prompt),
                               completion_tokens=len(output), cached_tokens=0)
        records.append(record)
    summary = summarize("x", records, duration_s=5.0)
    assert summary["ideal_cached_tokens"] == 12
    assert summary["ideal_cache_hit_rate"] == pytest.approx(12 / 22)


def test_shared_prefix_ideal_hit_rate_counts_each_group_prompt_once() -> None:
    workload = _gsp()
    cached = ideal_cached_tokens([(s.first_prompt, [5] * 4) for s in workload.sessions])
    # The first prompt of each group shares (by chance) at most a token or two; the others share the
    # whole 30-token system prompt, plus a question token only by chance.
    seen_groups: set[int] = set()
    for s, c in zip(workload.sessions, cached):
        if s.group in seen_groups:
            assert 30 <= c <= 31
        else:
            assert c <= 2
        seen_groups.add(s.group)


def test_multiturn_prompt_extends_previous_prompt_and_output_exactly() -> None:
    workload = _agent()
    session = workload.sessions[1]
    pieces = [session.first_prompt]
    assert pieces[0][:40] == workload.sessions[0].first_prompt[:40]  # the shared system prompt
    for turn in range(session.num_turns - 1):
        output = [100 + turn, 200 + turn, 300 + turn]
        nxt = session.next_pieces(turn, pieces, output)
        assert nxt[: len(pieces)] == pieces and nxt[len(pieces)] == output  # user and model turns alternate
        assert len(nxt) == len(pieces) + 2 and 3 <= len(nxt[-1]) <= 9
        pieces = nxt
    with pytest.raises(ValueError, match="no turn after"):
        session.next_pieces(session.num_turns - 1, pieces, [])


def test_random_prompts_share_nothing_beyond_chance() -> None:
    workload = random_prompts(VOCAB, num_prompts=30, input_len=50, output_len=3, seed=5)
    prompts = [s.first_prompt for s in workload.sessions]
    assert max(_common_prefix(a, b) for a, b in itertools.combinations(prompts, 2)) <= 2
    assert sum(ideal_cached_tokens([(p, []) for p in prompts])) <= 3


def test_bad_workload_parameters_are_named() -> None:
    with pytest.raises(ValueError, match="num_turns"):
        _agent(num_turns=0)
    with pytest.raises(ValueError, match="obs_len_max"):
        _agent(obs_len_min=5, obs_len_max=2)
    with pytest.raises(ValueError, match="--systems"):
        parse_config(["--systems", "sgl_lite,vllm"])


def test_command_line_passes_only_given_server_args() -> None:
    config = parse_config(["--systems", "sgl_lite", "--max-total-tokens", "4096", "--schedule-policy", "lpm"])
    assert config.systems == ("sgl_lite",)
    assert config.server_args == {"max_total_tokens": 4096, "schedule_policy": "lpm"}
    assert math.isinf(config.request_rate)


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    a = arrival_offsets(20, 4.0, seed=1)
    assert a == arrival_offsets(20, 4.0, seed=1) and a != arrival_offsets(20, 4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert arrival_offsets(3, math.inf, seed=1) == [0.0, 0.0, 0.0]


class _EchoBackend(GenerationBackend):
    """Answers with the prompt's last tokens; reports a prefix cache that remembers every sequence."""

    name = "echo"

    def __init__(self) -> None:
        self.seen: list[list[int]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def stream(self, input_ids: list[int], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        cached = ideal_cached_tokens([(s, []) for s in self.seen] + [(input_ids, [])])[-1]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        output = [(input_ids[-1] + k) % 997 + 3 for k in range(max_new_tokens)]
        self.seen.append(list(input_ids) + output)  # at send time, like the ideal's infinite cache
        for tok in output:
            await asyncio.sleep(0)  # let other requests interleave
            yield StreamEvent(asyncio.get_running_loop().time(), [tok])
        self.in_flight -= 1
        yield StreamEvent(asyncio.get_running_loop().time(), [], {"prompt_tokens": len(input_ids),
                                                                   "completion_tokens": len(output), "cached_tokens": cached})

    def reset(self) -> None:
        self.seen.clear()

    def close(self) -> None:
        pass


def test_driver_feeds_each_turn_the_actual_output_and_limits_concurrency() -> None:
    workload = _agent()
    backend = _EchoBackend()
    records, duration = asyncio.run(run_workload(backend, workload, max_concurrency=2))
    assert len(records) == workload.num_requests and all(r.ok for r in records)
    assert backend.max_in_flight == 2
    by_session = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    for session in workload.sessions:
        turns = sorted(by_session[session.session_id], key=lambda r: r.turn)
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt_ids == prev.prompt_ids + prev.output_ids + session.appendices[prev.turn]
    summary = summarize("echo", records, duration)
    assert summary["cache_hit_rate"] == pytest.approx(summary["ideal_cache_hit_rate"])
    assert [t["turn"] for t in summary["per_turn"]] == [0, 1, 2]
    assert summary["per_turn"][2]["ideal_hit_rate"] > summary["per_turn"][0]["ideal_hit_rate"]


@pytest.mark.skipif(importlib.util.find_spec("sgl_lite.lang.launcher") is None, reason="runtime launcher not built yet")
def test_end_to_end_smoke_multiturn(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from sgl_lite.bench.driver import run_benchmark

    config = BenchConfig(model_path=str(tiny_llama_dir), systems=("sgl_lite",), agent_num_sessions=2, agent_num_turns=2,
                         agent_system_prompt_len=32, agent_task_len=8, agent_obs_len_min=2, agent_obs_len_max=4,
                         agent_output_len=4, output_dir=str(tmp_path), progress=False,
                         server_args={"max_total_tokens": 2048, "dtype": "float32"})
    report = run_benchmark(config)
    (summary,) = report["systems"]
    assert summary["completed"] == 4 and summary["failed"] == 0
    for key in ("request_throughput", "input_throughput", "output_throughput", "cache_hit_rate", "ideal_cache_hit_rate"):
        assert summary[key] is not None and summary[key] > 0, key
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert all(summary[key][p] is not None for p in ("p50", "p90", "p99")), key
    assert summary["cache_hit_rate"] <= summary["ideal_cache_hit_rate"] + 1e-9
    saved = json.loads(Path(report["json_path"]).read_text())
    assert saved["systems"][0]["completed"] == 4
    assert all(Path(p).stat().st_size > 0 for p in report["plots"])
