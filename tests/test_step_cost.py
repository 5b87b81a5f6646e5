"""The draft-length policy's measured step costs: the estimator on synthetic timings, the policy reading
it, and the scheduler feeding it from its own decode forwards without changing greedy output."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.speculative.ngram_proposer import Acceptance, NgramProposer, NgramState, allocate_draft_tokens, worth_length
from sgl_lite.runtime.speculative.step_cost import DECODE_ROW_STEP_COST, DRAFT_TOKEN_STEP_COST, MIN_SAMPLES, NUM_BUCKETS, WINDOW, StepCost


def avx2_step(rows: float) -> float:
    """Seconds of a decode step on the AVX2-only EPYC (default model, bf16): 1-3 rows cost about the
    same, then each row adds ~3 ms."""
    return 1e-3 * float(np.interp(rows, [1, 3, 4, 8, 32, 256], [17, 18, 25, 38, 86, 534]))


def convex_step(rows: float) -> float:
    """A step bound by reading the weights at few rows and by arithmetic at many: each row costs more."""
    return 1e-3 * (16.0 + 0.3 * rows + 0.05 * rows**2)


def measure(cost: StepCost, curve, rows: range, rounds: int, factor: float = 1.0, seed: int = 0, noise: float = 0.3) -> None:
    rng = random.Random(seed)
    for _ in range(rounds):
        for r in rows:
            cost.record(r, factor * curve(r) * rng.uniform(1.1 - noise, 1.1 + noise))  # this box: 20-40% noise


def copying_req() -> Req:
    req = Req(rid="copy", input_ids=list(range(1, 40)) * 3, sampling_params=SamplingParams())
    req.output_ids = []
    return req


def test_the_prior_decides_until_enough_forwards_are_measured() -> None:
    proposer = NgramProposer(num_draft_tokens=12, min_window=1, max_window=4)
    chance = NgramState().acceptance()  # a new request's prior

    def lengths() -> list[int]:
        return [len(proposer.propose(copying_req(), limit=40, batch_size=b)) for b in (1, 2)]

    prior = [worth_length(chance, b, 12) for b in (1, 2)]
    assert lengths() == prior == [6, 5]
    for rows in (1, 2, 3, 5):  # one bucket full, the others short of MIN_SAMPLES: still the prior
        for _ in range(MIN_SAMPLES if rows == 1 else MIN_SAMPLES - 1):
            proposer.step_cost.record(rows, avx2_step(rows))
    assert not proposer.step_cost.measured and lengths() == prior
    measure(proposer.step_cost, avx2_step, range(1, 33), rounds=WINDOW)
    assert proposer.step_cost.measured
    # Measured: rows 2-3 cost next to nothing, the 4th adds 40% to the step: 2 draft tokens alone and 1
    # beside another request, where the prior drafts 6 and 5.
    assert lengths() == [2, 1]


def test_a_convex_step_time_gives_long_drafts_alone_and_short_ones_in_a_batch() -> None:
    steady = Acceptance(0.8, 0.8)
    for seed in range(3):
        cost = StepCost()
        measure(cost, convex_step, range(1, 65), rounds=WINDOW, seed=seed)
        times = cost.step_times(200)
        [alone] = allocate_draft_tokens([steady], [12], 1, times)
        [beside_decode_rows] = allocate_draft_tokens([steady], [12], 8, times)
        assert alone >= 6 and 0 < beside_decode_rows < alone / 2, (seed, alone, beside_decode_rows)
    # Eight requests alike share the step's rows evenly, each drafting less than one alone beside them would.
    cost = StepCost()
    measure(cost, convex_step, range(1, 65), rounds=MIN_SAMPLES, noise=0.0)
    times = cost.step_times(200)
    lengths = allocate_draft_tokens([steady] * 8, [12] * 8, 8, times)
    assert max(lengths) - min(lengths) <= 1 and 0 < max(lengths) <= allocate_draft_tokens([steady], [12], 8, times)[0], lengths


def expected_rate(acceptances: list[Acceptance], lengths: tuple[int, ...], batch_size: int, times: list[float]) -> float:
    tokens = batch_size + sum(a.expected(n) for a, n in zip(acceptances, lengths))
    return tokens / times[batch_size + sum(lengths)]


def test_the_joint_allocation_is_the_best_of_all_draft_lengths() -> None:
    rng = random.Random(0)
    for case in range(150):
        requests = rng.randrange(1, 4)
        acceptances = [Acceptance(rng.random(), rng.random()) for _ in range(requests)]
        caps = [rng.randrange(0, 5) for _ in range(requests)]
        batch_size = requests + rng.randrange(0, 6)
        # non-decreasing step times with flat stretches and steep steps
        times = list(np.cumsum([rng.choice([0.0, 0.1, 0.5, 3.0]) for _ in range(batch_size + sum(caps) + 1)]) + 10.0)
        lengths = allocate_draft_tokens(acceptances, caps, batch_size, times)
        assert all(0 <= n <= cap for n, cap in zip(lengths, caps)), (lengths, caps)
        best = max(expected_rate(acceptances, combo, batch_size, times)
                   for combo in itertools.product(*(range(cap + 1) for cap in caps)))
        assert expected_rate(acceptances, tuple(lengths), batch_size, times) >= best - 1e-12, (case, lengths)


def test_drafts_that_pay_only_together_are_taken() -> None:
    # A step time that jumps over the first extra rows (a register tile of rows filling up) and is nearly
    # flat after: no request's draft pays for the jump on its own, all eight together do.
    times = [0.0] + [20.0] * 8 + [30.0 + 0.1 * r for r in range(60)]
    likely = Acceptance(0.9, 0.9)
    assert allocate_draft_tokens([likely], [4], 8, times) == [0]
    assert allocate_draft_tokens([likely] * 8, [4] * 8, 8, times) == [4] * 8
    # Unlikely drafts stay out even then, and a request with nothing to draft gets nothing.
    assert allocate_draft_tokens([Acceptance(0.05, 0.5)] * 8, [4] * 8, 8, times) == [0] * 8
    assert allocate_draft_tokens([likely, likely], [0, 4], 8, times)[0] == 0


def test_stalled_forwards_do_not_move_the_estimate() -> None:
    cost, rng = StepCost(), random.Random(1)
    for _ in range(40):
        for rows in (1, 4, 8, 16):
            stalled = rng.random() < 0.1  # a neighbour took the core: a forward takes 5x
            cost.record(rows, avx2_step(rows) * (5.0 if stalled else rng.uniform(0.8, 1.4)))
    times = cost.step_times(16)
    # The fastest three quarters of 0.8-1.4x average ~1.03x; a plain mean would read ~1.5x, stalls included.
    for rows in (1, 4, 8, 16):
        assert 0.9 < times[rows] / avx2_step(rows) < 1.2, (rows, times[rows] / avx2_step(rows))


def test_a_load_change_moves_the_estimate_within_a_window() -> None:
    cost = StepCost()
    measure(cost, avx2_step, range(1, 17), rounds=3 * WINDOW)
    before = cost.step_times(16)[8]
    measure(cost, avx2_step, range(1, 17), rounds=WINDOW, factor=2.0, seed=1)  # a busy neighbour
    after = cost.step_times(16)[8]
    assert 0.9 < before / avx2_step(8) < 1.2
    assert 1.7 < after / before < 2.3, after / before
    assert cost.row_cost(8) > 0.0 and cost.last_rows == 16


def test_the_curve_is_non_decreasing_flat_below_and_never_free_beyond_what_was_measured() -> None:
    cost = StepCost()
    for _ in range(MIN_SAMPLES):
        cost.record(2, 0.010)
        cost.record(4, 0.009)  # noise: fewer seconds with more rows
        cost.record(6, 0.012)
        cost.record(12, 0.012)  # a flat last segment
    times = cost.step_times(20)
    assert times == sorted(times)
    assert times[0] == times[1] == times[2] == times[4] == pytest.approx(0.010)
    prior_slope = DRAFT_TOKEN_STEP_COST * 0.010 / (1 + 2 * DECODE_ROW_STEP_COST)
    assert times[14] - times[13] == pytest.approx(prior_slope)


def test_memory_stays_bounded() -> None:
    cost, rng = StepCost(), random.Random(2)
    for _ in range(50_000):
        rows = rng.choice([rng.randrange(1, 40), rng.randrange(1, 200_000)])
        cost.record(rows, avx2_step(min(rows, 256)) * rng.uniform(0.8, 1.4))
    assert len(cost._windows) <= NUM_BUCKETS and all(len(w) <= WINDOW for w in cost._windows.values())
    assert len(cost.points()) <= NUM_BUCKETS
    table = cost.step_times(300)
    assert table == sorted(table) and len(table) <= 600


# ---------------------------------------------------------------- the scheduler feeds it


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path):
    common = dict(model_path=str(tiny_llama_dir), max_total_tokens=4096, max_running_requests=16,
                  dtype="float32", device="cpu", chunked_prefill_size=64)
    plain = Engine(**common)
    spec = Engine(**common, speculative_algorithm="ngram")
    yield plain, spec
    for eng in (plain, spec):
        eng.shutdown()


PROMPTS = [
    "Repeat after me: the tool returned status ok, id 42, name alpha. Repeat after me: the tool returned",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "one two three four five one two three four five one two three",
]


def test_decode_and_verification_forwards_are_timed_and_greedy_output_stays_identical(engines) -> None:
    plain, spec = engines
    scheduler = spec.core.scheduler
    cost = scheduler.proposer.step_cost
    decode_rows: list[int] = []
    recorded: list[tuple[int, float]] = []
    forward, record = scheduler.runner.forward, cost.record

    def logged_forward(batch):
        if batch.is_decode or batch.draft_ids:
            decode_rows.append(batch.num_tokens)
        return forward(batch)

    def logged_record(rows: int, seconds: float) -> None:
        recorded.append((rows, seconds))
        record(rows, seconds)

    scheduler.runner.forward, cost.record = logged_forward, logged_record
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    try:
        spec.generate(PROMPTS, params)  # long enough to replace the prior
        assert cost.measured
        assert [rows for rows, _ in recorded] == decode_rows  # every decode forward, no prefill
        assert any(rows > len(PROMPTS) for rows in decode_rows) and all(s > 0 for _, s in recorded)
        got = spec.generate(PROMPTS, params)  # now drafted by the measured cost
    finally:
        scheduler.runner.forward, cost.record = forward, record
    assert [g["output_ids"] for g in got] == [e["output_ids"] for e in plain.generate(PROMPTS, params)]
    stats = scheduler.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_step_ms"] > 0.0 and stats["spec_row_ms"] >= 0.0
    scheduler.check_invariant()
