"""Waiting briefly for a turn's requests to arrive together, so they prefill as one batch.

Agent sessions move in lockstep: a batch of sessions finishes its turns in the same decode step, and each
client sends its next turn (the answer plus a tool observation) as soon as it has read the last chunk.
Those requests reach the scheduler over a few milliseconds (HTTP, chat template, tokenizing), so an idle
scheduler used to prefill the first to arrive alone: a prefill of ~80 rows, which runs at half the rate
of the batch of the rest that follows it, on a box whose cores the other requests' HTTP handling then
shares (measured in `python scripts/profile_serving.py --sessions 8`: every turn of an 8-session agent
run started with a lone prefill of 63-98 tokens taking 72-134 ms, then one of the other 7).

The rule: when a step finishes k > 1 requests and leaves nothing running, waiting or half prefilled,
the scheduler expects k requests back. Once the first of them arrives it starts no prefill, for up to
`window` seconds, while fewer than k are waiting; whatever is waiting when the window closes is
prefilled then. The window opens at the first arrival, not at the drain: the clients' round trip
(~20 ms above) comes before any of them, and the spread after the first is what is waited for (7-14 ms
in that run). A single session (k = 1) never waits: its own next turn is the one expected. A drain with
work still queued expects nothing (an offline batch never waits), and an expectation lapses EXPECT_S
after its drain (no herd takes that long). The cost is bounded: at most `window` seconds of one
request's latency, only right after a batch drained.
"""

from __future__ import annotations

from dataclasses import dataclass


EXPECT_S = 1.0  # an expectation older than this (since its drain) is dropped: those clients are not coming back together


@dataclass
class ArrivalGather:
    """The gathering state of one scheduler: how many requests it expects back, and until when."""

    window: float  # seconds from the first arrival; 0 disables gathering
    expected: int = 0  # 0: not gathering
    deadline: float = 0.0  # when the expectation lapses; once `opened`, when the window closes
    opened: bool = False  # whether the first expected request has arrived

    def on_drain(self, finished: int, now: float) -> None:
        """A step finished `finished` requests and left the scheduler with nothing to do."""
        if self.window > 0 and finished > 1:
            self.expected, self.deadline, self.opened = finished, now + EXPECT_S, False

    def holds(self, waiting: int, now: float) -> bool:
        """Whether an idle scheduler with `waiting` queued requests should wait for more before a prefill.
        Ends the gathering for good once enough have arrived or the window has closed."""
        if not self.expected:
            return False
        if waiting and not self.opened:  # the first arrival opens the window
            self.deadline, self.opened = min(self.deadline, now + self.window), True
        if waiting >= self.expected or now >= self.deadline:
            self.expected = 0
        return self.expected > 0 and waiting > 0

    def remaining(self, now: float) -> float:
        """Seconds left before a waiting request is prefilled anyway (0 when not holding one)."""
        return max(self.deadline - now, 0.0) if self.expected and self.opened else 0.0
