"""Fair prefill's chunks sized by time: a chunk of a long prompt is as long as a step should take.

A fixed `--chunked-prefill-size` is a token count, and what a chunk costs depends on the machine, its
load and how far back the chunk's attention reaches: on a loaded 2-core CPU one chunk of 2,048 tokens
took seconds, and a short request arriving meanwhile waited for it, however fair the turns after it.
So the scheduler measures its own prefill rate and, while there is someone to be fair to, gives a
chunk only the tokens that rate computes in TARGET_STEP_S.

Contract:
- `PrefillRate.record(tokens, seconds)`: one prefill forward (prefill rows plus any mixed decode
  rows) that took `seconds` on the scheduler's clock; non-positive inputs are ignored.
- `PrefillRate.tokens_per_s`: None before the first forward; else the rate of the last WINDOW
  forwards without the slowest quarter by seconds per token (step_cost.trimmed_point), so a stalled
  forward does not shrink chunks, and a load change (or a chunk reaching further back) shows within
  WINDOW forwards. Memory: WINDOW samples.
- `PrefillPacer.chunk_cap(others)`: the most prefill tokens a round that chunks a prompt may compute
  (PrefillAdder's `chunk_cap`): None (the whole chunk budget, as in SGLang) without `others` (a lone
  prompt keeps full chunks, for throughput) or before any measurement; else rate x TARGET_STEP_S,
  within [MIN_CHUNK_TOKENS, chunk size].

The rate includes each forward's fixed cost, so a chunk sized from small forwards is too small and
one sized from large forwards too large; either way the next forward's rate moves the chunk towards
the size whose step takes TARGET_STEP_S (n -> n T / (a + b n) has its fixed point at a + b n = T, and
converges since a < T).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sgl_lite.runtime.speculative.step_cost import trimmed_point

# What a chunk of a long prompt may take while others wait or decode. A short request arriving during
# a chunk waits for the round under way, for a decode step, and for its own round, which holds its
# prompt and at most MIN_CHUNK_TOKENS of the chunk (scheduler_prefill.py): the round under way is most
# of its wait. 0.15 s keeps that within a few times a short request's unloaded time to first token on a
# CPU, while a forward's fixed cost (tens of ms on a CPU, far less on a GPU, where a chunk of
# --chunked-prefill-size takes less than this anyway) costs the long prompt a modest share of its
# throughput (a shorter step costs it more: docs/safety.md).
TARGET_STEP_S = 0.15
# Below this a chunk costs mostly the forward's fixed cost: the long prompt would barely advance. Also
# what a chunk gets in a round that takes in waiting requests (they go first; the round stays short).
MIN_CHUNK_TOKENS = 64
WINDOW = 8  # prefill forwards kept: about a second of chunks at TARGET_STEP_S


@dataclass
class PrefillRate:
    """Prompt tokens per second of the scheduler's prefill forwards (see the module docstring)."""

    _window: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW), init=False)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens >= 1 and seconds > 0.0:
            self._window.append((tokens, seconds))

    @property
    def tokens_per_s(self) -> float | None:
        if not self._window:
            return None
        tokens, seconds = trimmed_point(self._window, per_unit=True)
        return tokens / seconds


@dataclass
class PrefillPacer:
    """The chunk cap of a prefill round from the measured rate (see the module docstring)."""

    chunk_size: int
    target_step_s: float = TARGET_STEP_S
    rate: PrefillRate = field(default_factory=PrefillRate)

    def chunk_cap(self, others: bool) -> int | None:
        """`others`: requests besides the one chunked are running or waiting."""
        rate = self.rate.tokens_per_s
        if not others or rate is None:
            return None
        return min(max(int(rate * self.target_step_s), MIN_CHUNK_TOKENS), self.chunk_size)
