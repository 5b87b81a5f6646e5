"""Draft tokens for n-gram speculative decoding, looked up in the request's own context.

Agents copy: they quote tool output, restate the task, re-emit code and fill JSON whose keys the prompt
holds. The last few tokens of such a request have usually been seen before in its prompt or output, and
what followed them then is a good guess of what follows now. For a request whose tokens are
`t[0..L)`, the proposer takes the longest suffix `t[L-n..L)` (n from the max window down to the min
window) that also ends at an earlier position e < L, the latest such e, and proposes `t[e..e+k)`.

Work per proposal is a few vectorized numpy passes over the request's tokens (no per-token Python),
kept in a per-request buffer that grows by the new outputs only.

How long a draft is worth verifying (`worth_length`): the j-th draft token is used only if the j - 1
before it were accepted, so with a per-token acceptance chance `a` it is accepted with probability a^j.
Verifying it costs one more query row of the step (its matmul rows, its logits, its attention), a
fraction `draft_token_cost(B)` of a step of B decode rows: small at batch 1, where a decode step is
bound by reading the weights, and growing with B, as the step becomes bound by arithmetic. A draft token
pays when a^j exceeds that fraction, so the draft is cut at the last j where it does: long drafts for a
request that keeps copying at batch 1, short or none at batch 16-32. `a` is each request's own
acceptance history (recent drafts weigh most), and a request whose drafts keep failing outright stops
drafting for a while (exponential back-off), so a workload that copies nothing costs almost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sgl_lite.runtime.managers.ngram_pool import SEPARATOR, NgramPool
from sgl_lite.runtime.managers.request import Req

# Back-off when acceptance is poor: after this many consecutive fully rejected drafts, skip drafting for
# BACKOFF_START steps, doubling each time it happens again (up to BACKOFF_MAX); an accepted draft resets it.
MAX_FAILED_DRAFTS = 3
BACKOFF_START = 4
BACKOFF_MAX = 256

# The cost of one draft token as a fraction of a one-request decode step (DRAFT_TOKEN_STEP_COST), and what
# each decode row adds to a step (DECODE_ROW_STEP_COST), both relative to a one-request step. Measured
# on the project's CPU box with the default model, bf16 (`python scripts/bench_speculative.py --step-cost`,
# 2026-11-24 04:10, load ~1): a draft token (its matmul rows, its lm_head row, one decode-kernel query)
# costs 0.52 ms and a decode row 0.58 ms, against a 9.5 ms one-request step. Both scale with the model as
# the step does, so the fractions carry over roughly; they are a policy, not an exact cost.
DRAFT_TOKEN_STEP_COST = 0.055
DECODE_ROW_STEP_COST = 0.06

# Acceptance estimate: a Beta-like prior of PRIOR_ACCEPTED accepted out of PRIOR_TRIED tried draft tokens,
# plus the request's own history, older drafts' counts multiplied by HISTORY_DECAY at each new draft.
PRIOR_ACCEPTED = 1.0
PRIOR_TRIED = 2.0
HISTORY_DECAY = 0.5


def draft_token_cost(batch_size: int) -> float:
    """One draft token's verification cost as a fraction of a step of `batch_size` decode rows."""
    return batch_size * DRAFT_TOKEN_STEP_COST / (1.0 + batch_size * DECODE_ROW_STEP_COST)


def worth_length(accept_chance: float, batch_size: int, cap: int) -> int:
    """The longest draft (at most `cap`) whose last token still pays for itself: largest j with
    accept_chance ** j > draft_token_cost(batch_size); 0 when even the first does not."""
    cost = draft_token_cost(batch_size)
    if cost >= 1.0 or accept_chance <= cost:
        return 0
    if accept_chance >= 1.0:
        return cap
    return min(cap, math.ceil(math.log(cost) / math.log(accept_chance)) - 1)


@dataclass
class NgramState:
    """A request's token buffer and its drafting history."""

    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    length: int = 0
    accepted: float = 0.0  # decayed counts of accepted and of tried draft tokens
    tried: float = 0.0
    failed_in_a_row: int = 0
    skip_steps: int = 0
    backoff: int = BACKOFF_START

    @property
    def accept_chance(self) -> float:
        """Estimated chance that a draft token is accepted, given the ones before it were."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.tried + PRIOR_TRIED)

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
    match = suffix_match(tokens, min_window, max_window)
    return None if match is None else match[0]


def suffix_match(tokens: np.ndarray, min_window: int, max_window: int) -> tuple[int, int] | None:
    """(e, n) of longest_suffix_match: the end position and the number of tokens matched."""
    length = tokens.shape[0]
    if length < min_window + 1:
        return None
    # Candidate ends e in [min_window, L): tokens[e - 1] equals the last token.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) + 1
    ends = ends[ends >= min_window]
    best: tuple[int, int] | None = None
    n = 1
    while ends.size and n <= max_window:
        if n >= min_window:
            best = int(ends[-1]), n  # latest end matching n tokens
        if n == max_window:
            break
        ends = ends[ends - n - 1 >= 0]
        ends = ends[tokens[ends - n - 1] == tokens[length - n - 1]]
        n += 1
    return best


class NgramProposer:
    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int, pool_capacity: int = 0) -> None:
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
        self.pool = NgramPool(pool_capacity) if pool_capacity > 0 else None
        self.num_pool_drafts = 0  # drafts that came from the pool

    def propose(self, req: Req, limit: int, batch_size: int = 1) -> list[int]:
        """Draft tokens following `req`'s tokens (at most `limit`, and only as many as are worth
        verifying in a step of `batch_size` decode rows), or []."""
        state: NgramState | None = req.spec_state
        if state is None:
            state = req.spec_state = NgramState()
        if state.skip_steps > 0:
            state.skip_steps -= 1
            return []
        limit = min(limit, worth_length(state.accept_chance, batch_size, self.num_draft_tokens))
        if limit <= 0:
            return []
        tokens = state.sync(req)
        own = suffix_match(tokens, self.min_window, self.max_window)
        if self.pool is None or not self.pool.size or (own is not None and own[1] == self.max_window):
            return [] if own is None else tokens[own[0] : own[0] + limit].tolist()
        # The pool's match wins only when longer than the request's own: the pool followed by the
        # request's last tokens. A match within those last tokens is one the own search found already.
        pooled = self.pool.joined()
        shortest = self.min_window if own is None else own[1] + 1
        pool = suffix_match(np.concatenate((pooled, tokens[-self.max_window:])), shortest, self.max_window)
        if pool is None or pool[0] >= pooled.shape[0]:
            return [] if own is None else tokens[own[0] : own[0] + limit].tolist()
        end = pool[0]
        draft = pooled[end : end + limit]
        cut = np.flatnonzero(draft == SEPARATOR)  # a draft ends with the output it came from
        draft = draft[: cut[0]] if cut.size else draft
        self.num_pool_drafts += bool(draft.size)
        return draft.tolist()

    def remember(self, req: Req) -> None:
        """A finished request's output joins the shared pool (when there is one)."""
        if self.pool is not None:
            self.pool.add(req.output_ids)

    def record(self, req: Req, num_drafted: int, num_accepted: int) -> None:
        """Feed back a verified draft: its first `num_accepted` of `num_drafted` tokens matched the model."""
        state: NgramState = req.spec_state
        self.num_drafts += 1
        self.num_draft_tokens_total += num_drafted
        self.num_accepted_total += num_accepted
        req.spec_draft_tokens += num_drafted
        req.spec_accepted_tokens += num_accepted
        # Tokens after the first rejection were never tried on their own: they say nothing of the chance.
        state.accepted = HISTORY_DECAY * state.accepted + num_accepted
        state.tried = HISTORY_DECAY * state.tried + min(num_accepted + 1, num_drafted)
        if num_accepted:
            state.failed_in_a_row, state.backoff = 0, BACKOFF_START
            return
        state.failed_in_a_row += 1
        if state.failed_in_a_row >= MAX_FAILED_DRAFTS:
            state.failed_in_a_row = 0
            state.skip_steps = state.backoff
            state.backoff = min(2 * state.backoff, BACKOFF_MAX)

    def stats(self) -> dict[str, float]:
        drafted = self.num_draft_tokens_total
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": self.num_accepted_total,
            "spec_accept_rate": self.num_accepted_total / drafted if drafted else 0.0,
            "spec_pool_drafts": self.num_pool_drafts,
        }
