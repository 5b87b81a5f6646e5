"""Draft tokens for n-gram speculative decoding, looked up in the request's own context.

Agents copy: they quote tool output, restate the task, re-emit code and fill JSON whose keys the prompt
holds. The last few tokens of such a request have usually been seen before in its prompt or output, and
what followed them then is a good guess of what follows now. For a request whose tokens are
`t[0..L)`, the proposer takes the longest suffix `t[L-n..L)` (n from the max window down to the min
window) that also ends at an earlier position e < L, the latest such e, and proposes `t[e..e+k)`.

Work per proposal is a few vectorized numpy passes over the request's tokens (no per-token Python),
kept in a per-request buffer that grows by the new outputs only. Per request the draft length adapts:
after a draft is verified, the next one may be at most one token longer than what was accepted, and a
request whose drafts keep failing stops drafting for a while (exponential back-off), so a workload that
copies nothing costs almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sgl_lite.runtime.managers.request import Req

# Back-off when acceptance is poor: after this many consecutive fully rejected drafts, skip drafting for
# BACKOFF_START steps, doubling each time it happens again (up to BACKOFF_MAX); an accepted draft resets it.
MAX_FAILED_DRAFTS = 3
BACKOFF_START = 4
BACKOFF_MAX = 256


@dataclass
class NgramState:
    """A request's token buffer and its adaptive drafting state."""

    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    length: int = 0
    max_draft: int = 0  # next draft's length cap (adapts to what was accepted)
    failed_in_a_row: int = 0
    skip_steps: int = 0
    backoff: int = BACKOFF_START

    def sync(self, req: Req) -> np.ndarray:
        """The request's prompt + output as an array (appending only what is new since the last call)."""
        total = len(req.input_ids) + len(req.output_ids)
        if total > self.tokens.shape[0]:
            grown = np.empty(max(total, 2 * self.tokens.shape[0], 64), dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        if self.length < len(req.input_ids):
            self.tokens[self.length : len(req.input_ids)] = req.input_ids[self.length :]
            self.length = len(req.input_ids)
        start = self.length - len(req.input_ids)
        new = req.output_ids[start:]
        self.tokens[self.length : self.length + len(new)] = new
        self.length += len(new)
        return self.tokens[: self.length]


def longest_suffix_match(tokens: np.ndarray, min_window: int, max_window: int) -> int | None:
    """End position e < len(tokens) of the latest earlier occurrence of the longest suffix of `tokens`
    with at least `min_window` and at most `max_window` tokens; None when even the shortest has none.

    `tokens[e - n : e] == tokens[L - n : L]` for the n found, and `tokens[e:]` is what followed it.
    """
    length = tokens.shape[0]
    if length < min_window + 1:
        return None
    # Candidate ends e in [min_window, L): tokens[e - 1] equals the last token.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) + 1
    ends = ends[ends >= min_window]
    best: int | None = None
    n = 1
    while ends.size and n <= max_window:
        if n >= min_window:
            best = int(ends[-1])  # latest end matching n tokens
        if n == max_window:
            break
        ends = ends[ends - n - 1 >= 0]
        ends = ends[tokens[ends - n - 1] == tokens[length - n - 1]]
        n += 1
    return best


class NgramProposer:
    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1; got {num_draft_tokens}")
        if not 1 <= min_window <= max_window:
            raise ValueError(f"n-gram windows must satisfy 1 <= min ({min_window}) <= max ({max_window})")
        self.num_draft_tokens = num_draft_tokens
        self.min_window = min_window
        self.max_window = max_window
        self.num_drafts = 0
        self.num_draft_tokens_total = 0
        self.num_accepted_total = 0

    def propose(self, req: Req, limit: int) -> list[int]:
        """Up to min(limit, the request's adaptive cap) draft tokens following `req`'s tokens, or []."""
        state: NgramState | None = req.spec_state
        if state is None:
            state = req.spec_state = NgramState(max_draft=self.num_draft_tokens)
        if state.skip_steps > 0:
            state.skip_steps -= 1
            return []
        limit = min(limit, state.max_draft)
        if limit <= 0:
            return []
        tokens = state.sync(req)
        end = longest_suffix_match(tokens, self.min_window, self.max_window)
        if end is None:
            return []
        return tokens[end : end + limit].tolist()

    def record(self, req: Req, num_drafted: int, num_accepted: int) -> None:
        """Feed back a verified draft: `num_accepted` of its `num_drafted` tokens matched the model."""
        state: NgramState = req.spec_state
        self.num_drafts += 1
        self.num_draft_tokens_total += num_drafted
        self.num_accepted_total += num_accepted
        req.spec_draft_tokens += num_drafted
        req.spec_accepted_tokens += num_accepted
        state.max_draft = min(self.num_draft_tokens, num_accepted + 1)
        if num_accepted:
            state.failed_in_a_row, state.backoff = 0, BACKOFF_START
            return
        state.failed_in_a_row += 1
        if state.failed_in_a_row >= MAX_FAILED_DRAFTS:
            state.failed_in_a_row = 0
            state.skip_steps = state.backoff
            state.backoff = min(2 * state.backoff, BACKOFF_MAX)
            state.max_draft = self.num_draft_tokens

    def stats(self) -> dict[str, float]:
        drafted = self.num_draft_tokens_total
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": self.num_accepted_total,
            "spec_accept_rate": self.num_accepted_total / drafted if drafted else 0.0,
        }
