"""What a decode step costs as a function of its query rows, measured on the running server.

The draft-length policy (ngram_proposer.py) weighs a draft token's expected gain against the time its
query row adds to the step. That time depends on the CPU's kernels and on the load: on an AVX512-BF16
box a row adds ~5% of a one-request step at any batch; on an AVX2-only one a step of 1-3 rows costs
about the same and each row beyond adds far more, because the matmuls turn compute bound. So the
scheduler times every decode and verification forward (`record`; not prefill or mixed batches, whose
cost is of another kind) and the policy reads the curve back (`step_times`).

Contract:
- `record(rows, seconds)`: one decode/verification forward of `rows` query tokens (decode rows plus
  draft tokens); non-positive times are ignored.
- `measured`: whether the curve is known well enough to replace the prior, i.e. at least
  MIN_MEASURED_BUCKETS row-count buckets hold MIN_SAMPLES forwards each. Until then the policy uses the
  fixed prior below (`draft_token_cost`), exactly as before measurements existed.
- `step_times(max_rows)`: estimated seconds of a step of r rows for r = 0..max_rows, non-decreasing in r;
  only when `measured`.

Estimate: forwards go into buckets by row count (one per count up to EXACT_ROWS, then each 1.5x wider,
NUM_BUCKETS in all), each keeping its last WINDOW forwards. A bucket's point is the mean of the fastest
three quarters of them: timings on a shared box vary 20-40% and a neighbour taking a core stalls some
forwards for several times their cost, always upwards, so up to one forward in four may stall without
moving the point; a load change is followed within WINDOW forwards of the bucket (from the first
quarter on). Between points the curve is linear, and made non-decreasing; below the fewest rows
measured it is flat; beyond the most it rises by the last segment's slope, or by the prior's draft-token
cost if that is more, so rows never seen are not free.
Memory: NUM_BUCKETS * WINDOW samples, plus the table the policy asked for.
The same trimmed estimate (`trimmed_point`) measures the prefill rate (managers/prefill_pacing.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

# The prior: a draft token's cost as a fraction of a one-request decode step, and what each decode row adds
# to a step, as `python scripts/bench_speculative.py --step-cost` finds them for the default model in bf16
# on AVX512-BF16 (docs/speculative.md, "How it works"). They decide until the runtime has measured its own
# steps, and after that set the least a row beyond the most rows measured is assumed to cost.
DRAFT_TOKEN_STEP_COST = 0.055
DECODE_ROW_STEP_COST = 0.06

# Buckets: one per row count up to EXACT_ROWS (a CPU's curve bends within the first few rows), then each
# 1.5x wider than the one before, so that neighbouring points differ by more than their noise (a bucket of
# single rows at 16 would read a 4% step-time rise through ~5% noise). The last holds ~4000 rows and more.
EXACT_ROWS = 4
BUCKET_GROWTH = 1.5
NUM_BUCKETS = 22
WINDOW = 24  # forwards kept per bucket
MIN_SAMPLES = 4
MIN_MEASURED_BUCKETS = 2


def draft_token_cost(batch_size: int) -> float:
    """The prior: one draft token's verification cost as a fraction of a step of `batch_size` decode rows."""
    return batch_size * DRAFT_TOKEN_STEP_COST / (1.0 + batch_size * DECODE_ROW_STEP_COST)


def trimmed_point(samples: Collection[tuple[int, float]], per_unit: bool = False) -> tuple[float, float]:
    """(mean amount, mean seconds) of timed forwards, (amount, seconds) each, without the slowest quarter:
    a neighbour taking a core only ever lengthens a forward, so up to one in four may stall without moving
    the point. Slowest by seconds (samples of about the same amount), or by seconds per unit (`per_unit`)."""
    ordered = sorted(samples, key=(lambda s: s[1] / s[0]) if per_unit else (lambda s: s[1]))
    kept = ordered[: len(ordered) - len(ordered) // 4]
    return sum(a for a, _ in kept) / len(kept), sum(s for _, s in kept) / len(kept)


def bucket_of(rows: int) -> int:
    if rows <= EXACT_ROWS:
        return max(rows, 1) - 1
    return min(EXACT_ROWS + int(math.log(rows / EXACT_ROWS) / math.log(BUCKET_GROWTH)), NUM_BUCKETS - 1)


@dataclass
class StepCost:
    """Decode-step time against query rows, from the runtime's own forwards (see the module docstring)."""

    last_rows: int = 0  # the latest recorded forward's rows
    _windows: dict[int, deque[tuple[int, float]]] = field(default_factory=dict, init=False)
    _points: dict[int, tuple[float, float]] = field(default_factory=dict, init=False)  # buckets of MIN_SAMPLES+
    _table: list[float] = field(default_factory=list, init=False)
    _stale: bool = field(default=False, init=False)  # a point changed since the table was built

    def record(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0.0:
            return
        self.last_rows = rows
        bucket = bucket_of(rows)
        window = self._windows.get(bucket)
        if window is None:
            window = self._windows[bucket] = deque(maxlen=WINDOW)
        window.append((rows, seconds))
        if len(window) >= MIN_SAMPLES:
            self._points[bucket] = trimmed_point(window)
            self._stale = True

    @property
    def measured(self) -> bool:
        return len(self._points) >= MIN_MEASURED_BUCKETS

    def points(self) -> list[tuple[float, float]]:
        """(mean rows, seconds) per measured bucket, fewest rows first."""
        return [self._points[b] for b in sorted(self._points)]

    def step_times(self, max_rows: int) -> list[float]:
        """Estimated seconds of a step of r query rows, index r = 0..max_rows (or more)."""
        assert self.measured, "step_times before enough forwards were recorded"
        # Rebuilt once per recorded forward and grown geometrically: the policy asks for every request.
        if len(self._table) <= max_rows:
            self._table = self._build(max(max_rows + 1, 2 * len(self._table), 64))
        elif self._stale:
            self._table = self._build(len(self._table))
        self._stale = False
        return self._table

    def row_cost(self, rows: int) -> float:
        """Estimated seconds one more query row adds to a step of `rows` rows (0.0 before `measured`)."""
        if not self.measured:
            return 0.0
        table = self.step_times(rows + 1)
        return table[rows + 1] - table[rows]

    def _build(self, size: int) -> list[float]:
        points = self.points()
        xs = np.array([r for r, _ in points])
        ys = np.maximum.accumulate(np.array([s for _, s in points]))  # more rows never cost less
        rows = np.arange(size, dtype=np.float64)
        times = np.interp(rows, xs, ys)  # flat outside the measured range; the right side is redone below
        prior_slope = DRAFT_TOKEN_STEP_COST * ys[0] / (1.0 + DECODE_ROW_STEP_COST * xs[0])
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), prior_slope)
        beyond = rows > xs[-1]
        times[beyond] = ys[-1] + slope * (rows[beyond] - xs[-1])
        return times.tolist()
