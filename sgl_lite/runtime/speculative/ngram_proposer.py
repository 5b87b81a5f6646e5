"""Draft tokens for n-gram speculative decoding, looked up in the request's own context.

Agents copy: they quote tool output, restate the task, re-emit code and fill JSON whose keys the prompt
holds. The last few tokens of such a request have usually been seen before in its prompt or output, and
what followed them then is a good guess of what follows now. For a request whose tokens are
`t[0..L)`, the proposer takes the longest suffix `t[L-n..L)` (n from the max window down to the min
window) that also ends at an earlier position e < L, the latest such e, and proposes `t[e..e+k)`. A
longer match in the shared pool of recent outputs (ngram_pool.py) wins over it; failing both, the suffix
is looked up layout-free (ngram_layout.py: a copy laid out anew still matches its source).

Work per proposal is a few vectorized numpy passes over the request's tokens (no per-token Python),
kept in a per-request buffer that grows by the new outputs only.

How long a draft is worth verifying: the j-th draft token is used only if the j - 1 before it were
accepted, while it costs the step one more query row. Copying is bursty: a draft's first token is the
gamble (is this the span the request copies?), and once it is accepted the next ones usually are too.
So acceptance has two rates (`Acceptance`): `first`, the chance of the first token, and `then`, the
chance of each later one given the ones before it; token j is accepted with probability
first * then^(j - 1). (One rate for both made a copying request draft 2-3 tokens where its spans ran 10.)
Throughput is a step's expected tokens over its time, and the step's time depends only on its total
query rows (step_cost.py: read from the runtime's own forwards), so the step's drafts are sized together
(`allocate_draft_tokens`): the likeliest draft tokens of all its requests first, as many as raise the
step's expected tokens per second. On a CPU the first few rows of a step cost little (it reads all the
weights anyway) and the ones beyond much more, so drafts come out long at batch 1 and short or none in a
big batch. Until enough forwards are measured, the fixed prior decides (`worth_length`: the last j whose
chance exceeds step_cost.draft_token_cost(B)). Both
rates are each request's own history (recent drafts weigh most), and a request whose drafts keep failing
outright stops drafting for a while (exponential back-off), so a workload that copies nothing costs
almost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.speculative.ngram_layout import LayoutFreeView, grown
from sgl_lite.runtime.speculative.ngram_pool import SEPARATOR, NgramPool
from sgl_lite.runtime.speculative.step_cost import StepCost, draft_token_cost

# Back-off when acceptance is poor: after this many consecutive fully rejected drafts, skip drafting for
# BACKOFF_START steps, doubling each time it happens again (up to BACKOFF_MAX); an accepted draft resets it.
MAX_FAILED_DRAFTS = 3
BACKOFF_START = 4
BACKOFF_MAX = 256

# Acceptance estimates: Beta-like priors (pseudo-counts of tried draft tokens at the prior's chance) plus
# the request's own history, older drafts' counts multiplied by HISTORY_DECAY at each new draft. The prior is
# what the server's recent drafts of all requests say (POPULATION_DECAY per draft: ~30 drafts' memory), itself
# starting from a first token accepted 1 time in 2 and a later one 2 in 3 (copied spans run on). Without it, a
# new request in a batch whose rows are dear never drafts at the fixed prior, so never learns it should.
PRIOR_WEIGHT_FIRST = 2.0
PRIOR_WEIGHT_THEN = 3.0
HISTORY_DECAY = 0.5
POPULATION_DECAY = 0.97


@dataclass(frozen=True)
class Acceptance:
    """The chance that a draft's first token is accepted, and that each later one is given the ones before it."""

    first: float
    then: float

    def token(self, j: int) -> float:
        """The chance that draft token j (from 1) is accepted, the ones before it included."""
        return self.first * self.then ** (j - 1)

    def expected(self, length: int) -> float:
        """Expected accepted tokens of a draft of `length`: first * (1 + then + ... + then^(length - 1))."""
        if length <= 0:
            return 0.0
        if self.then >= 1.0:
            return self.first * length
        return self.first * (1.0 - self.then**length) / (1.0 - self.then)


def worth_length(acceptance: Acceptance, batch_size: int, cap: int) -> int:
    """The prior's rule, until step times are measured: the longest draft (at most `cap`) whose last token
    still pays for itself, the largest j with acceptance.token(j) > draft_token_cost(batch_size); 0 when
    even the first does not."""
    cost = draft_token_cost(batch_size)
    if cost >= 1.0 or acceptance.first <= cost:
        return 0
    if acceptance.then >= 1.0:
        return cap
    if acceptance.then <= 0.0:
        return 1
    # first * then^(j - 1) > cost  <=>  j - 1 < log(cost / first) / log(then)
    return min(cap, math.ceil(math.log(cost / acceptance.first) / math.log(acceptance.then)))


def allocate_draft_tokens(acceptances: list[Acceptance], caps: list[int], batch_size: int,
                          step_times: list[float]) -> list[int]:
    """How many draft tokens each drafting request of a step of `batch_size` decode rows verifies (at most
    its cap), decided for the step as a whole.

    Token j of request i is accepted with chance acceptances[i].token(j), which falls along a draft. For
    any total T of draft tokens the T likeliest tokens (a prefix of each request's draft) give the most
    expected tokens, and the step's time depends on T alone (batch_size + T query rows). So the T that
    maximizes (batch_size + their chances) / step_times[batch_size + T] gives the best allocation there
    is. Deciding request by request misses it where the curve rises steeply for a few rows and then
    flattens (a register tile of rows filling up): no single draft pays for the steep rows, the drafts
    together do. (Before step times are measured, the prior's cost is linear in the rows: `worth_length`
    decides each request alone, and the two agree.)
    """
    # (-chance, request, j): ties keep a request's tokens in draft order, so the top T is a prefix of each draft
    ranked = sorted((-a.token(j), i, j) for i, (a, cap) in enumerate(zip(acceptances, caps)) for j in range(1, cap + 1))
    best, best_rate, tokens = 0, batch_size / step_times[batch_size], float(batch_size)
    for total, (negative_chance, _, _) in enumerate(ranked, start=1):
        tokens -= negative_chance
        rate = tokens / step_times[batch_size + total]
        if rate > best_rate:
            best, best_rate = total, rate
    lengths = [0] * len(caps)
    for _, i, _ in ranked[:best]:
        lengths[i] += 1
    return lengths


FIXED_PRIOR = Acceptance(0.5, 2.0 / 3.0)


@dataclass
class DraftCounts:
    """Decayed counts of accepted and of tried draft tokens: first tokens, and later ones (after an accepted one)."""

    first_accepted: float = 0.0
    first_tried: float = 0.0
    then_accepted: float = 0.0
    then_tried: float = 0.0

    def record(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        """A verified draft: its first `num_accepted` of `num_drafted` tokens matched the model. Tokens after
        the first rejection were never tried on their own: they say nothing of either chance."""
        self.first_accepted = decay * self.first_accepted + (num_accepted > 0)
        self.first_tried = decay * self.first_tried + 1
        later_tried = min(num_accepted + 1, num_drafted) - 1 if num_accepted else 0
        self.then_accepted = decay * self.then_accepted + max(num_accepted - 1, 0)
        self.then_tried = decay * self.then_tried + later_tried

    def acceptance(self, prior: Acceptance) -> Acceptance:
        return Acceptance((self.first_accepted + PRIOR_WEIGHT_FIRST * prior.first) / (self.first_tried + PRIOR_WEIGHT_FIRST),
                          (self.then_accepted + PRIOR_WEIGHT_THEN * prior.then) / (self.then_tried + PRIOR_WEIGHT_THEN))


@dataclass
class NgramState:
    """A request's token buffer and its drafting history."""

    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    length: int = 0
    counts: DraftCounts = field(default_factory=DraftCounts)
    failed_in_a_row: int = 0
    skip_steps: int = 0
    backoff: int = BACKOFF_START
    layout: LayoutFreeView = field(default_factory=LayoutFreeView)

    def acceptance(self, prior: Acceptance = FIXED_PRIOR) -> Acceptance:
        """The request's chances: its own drafts' counts on top of `prior` (the server's recent drafts')."""
        return self.counts.acceptance(prior)

    def truncate(self, length: int) -> None:
        """Forget the tokens from position `length` on (a jump-forward retokenized them)."""
        self.length = min(self.length, length)
        self.layout.truncate(self.length)

    def sync(self, req: Req) -> np.ndarray:
        """The request's prompt + output as an array (appending only what is new since the last call)."""
        self.tokens = grown(self.tokens, len(req.input_ids) + len(req.output_ids), self.length)
        if self.length < len(req.input_ids):
            self.tokens[self.length : len(req.input_ids)] = req.input_ids[self.length :]
            self.length = len(req.input_ids)
        start = self.length - len(req.input_ids)
        new = req.output_ids[start:]
        self.tokens[self.length : self.length + len(new)] = new
        self.length += len(new)
        return self.tokens[: self.length]


def state_of(req: Req) -> NgramState:
    """The request's drafting state, made on its first use."""
    if req.spec_state is None:
        req.spec_state = NgramState()
    return req.spec_state


def longest_suffix_match(tokens: np.ndarray, min_window: int, max_window: int) -> int | None:
    """End position e < len(tokens) of the latest earlier occurrence of the longest suffix of `tokens`
    with at least `min_window` and at most `max_window` tokens; None when even the shortest has none.

    `tokens[e - n : e] == tokens[L - n : L]` for the n found, and `tokens[e:]` is what followed it.
    """
    match = suffix_match(tokens, min_window, max_window)
    return None if match is None else match[0]


def suffix_match(tokens: np.ndarray, min_window: int, max_window: int,
                 haystack: np.ndarray | None = None) -> tuple[int, int] | None:
    """(e, n) of longest_suffix_match: the end position and the number of tokens matched. With `haystack`,
    the suffix of `tokens` is looked up there instead (any end e <= len(haystack); -1 never matches)."""
    length = tokens.shape[0]
    if length < min_window + (haystack is None):
        return None
    hay = tokens[: length - 1] if haystack is None else haystack
    # Candidate ends e in [min_window, len(hay)]: hay[e - 1] equals the last token.
    ends = np.flatnonzero(hay == tokens[length - 1]) + 1
    ends = ends[ends >= min_window]
    best: tuple[int, int] | None = None
    n = 1
    while ends.size and n <= max_window:
        if n >= min_window:
            best = int(ends[-1]), n  # latest end matching n tokens
        if n == max_window or n == length:
            break
        ends = ends[ends - n - 1 >= 0]
        ends = ends[hay[ends - n - 1] == tokens[length - n - 1]]
        n += 1
    return best


class NgramProposer:
    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int, pool_capacity: int = 0,
                 layout_keys: np.ndarray | None = None) -> None:
        """`layout_keys`: ngram_layout.layout_free_keys of the served tokenizer, or None (no layout-free lookup)."""
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
        self.num_pool_drafts = 0  # drafts (verified ones) that came from the pool
        self.layout_keys = layout_keys
        self.step_cost = StepCost()  # the scheduler records its decode forwards here
        self.population = DraftCounts()  # every request's drafts: a new request's prior

    def propose(self, req: Req, limit: int, batch_size: int = 1) -> list[int]:
        """`propose_step` for one drafting request in a step of `batch_size` decode rows."""
        return self.propose_step([(req, limit)], batch_size)[0]

    def propose_step(self, requests: list[tuple[Req, int]], batch_size: int | None = None) -> list[list[int]]:
        """One decode step's drafts: for each (request, limit), the tokens that follow the request's
        tokens (at most `limit` and the proposer's cap, none its grammar forbids), as many as are worth
        verifying in a step of `batch_size` decode rows (default: one per request), or []."""
        batch_size = len(requests) if batch_size is None else batch_size
        prior = self.population.acceptance(FIXED_PRIOR)
        acceptances, caps = [], []
        for req, limit in requests:
            state = state_of(req)
            acceptances.append(state.acceptance(prior))
            if state.skip_steps > 0:
                state.skip_steps -= 1
                caps.append(0)
            else:
                caps.append(max(0, min(limit, self.num_draft_tokens)))
        # What each request is granted were every draft as long as its cap: only those are looked up (a
        # lookup is a few numpy passes over a request's tokens; in a big batch most requests get nothing).
        times = self.step_cost.step_times(batch_size + sum(caps)) if self.step_cost.measured else None
        if times is not None:
            caps = allocate_draft_tokens(acceptances, caps, batch_size, times)
        else:  # the prior decides each request alone
            caps = [worth_length(a, batch_size, cap) if cap > 0 else 0 for a, cap in zip(acceptances, caps)]
        drafts, pooled = [], []
        for (req, _), cap in zip(requests, caps):
            draft, from_pool = self.lookup(req, cap)
            if draft and req.grammar is not None:
                draft = draft[: req.grammar.allowed_prefix(draft)]  # a token the grammar forbids ends the draft
            drafts.append(draft)
            pooled.append(from_pool)
        if times is not None and any(len(d) < cap for d, cap in zip(drafts, caps)):  # drafts found short of their grant: size again
            lengths = allocate_draft_tokens(acceptances, [len(d) for d in drafts], batch_size, times)
            drafts = [d[:n] for d, n in zip(drafts, lengths)]
        self.num_pool_drafts += sum(bool(d) and p for d, p in zip(drafts, pooled))
        return drafts

    def lookup(self, req: Req, limit: int) -> tuple[list[int], bool]:
        """Up to `limit` tokens after the longest match of `req`'s suffix, in its own tokens or the pool,
        or else of its layout-free suffix in its own tokens (ngram_layout.py), and whether they came from
        the pool (no policy: what a draft of `limit` would be)."""
        if limit <= 0:
            return [], False
        state = state_of(req)
        tokens = state.sync(req)
        own = suffix_match(tokens, self.min_window, self.max_window)
        if own is not None and own[1] == self.max_window:
            return tokens[own[0] : own[0] + limit].tolist(), False
        if self.pool is not None and self.pool.size:
            # The pool's match wins only when longer than the request's own.
            pooled = self.pool.joined()
            shortest = self.min_window if own is None else own[1] + 1
            pool = suffix_match(tokens[-self.max_window:], shortest, self.max_window, haystack=pooled)
            if pool is not None:
                draft = pooled[pool[0] : pool[0] + limit]
                cut = np.flatnonzero(draft == SEPARATOR)  # a draft ends with the output it came from
                if cut.size:
                    draft = draft[: cut[0]]
                if draft.size:
                    return draft.tolist(), True
        own_length = 0 if own is None else own[1]
        if self.layout_keys is not None:
            # Layout-free, it must match more tokens than the exact match did, and two at least: one key
            # alone (a quote, a comma) is everywhere.
            keys, positions = state.layout.update(tokens, self.layout_keys)
            free = suffix_match(keys, max(self.min_window, own_length + 1, 2), self.max_window)
            if free is not None:
                start = int(positions[free[0] - 1]) + 1  # the source's token after the last one matched
                return tokens[start : start + limit].tolist(), False
        return ([] if own is None else tokens[own[0] : own[0] + limit].tolist()), False

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
        state.counts.record(num_drafted, num_accepted, HISTORY_DECAY)
        self.population.record(num_drafted, num_accepted, POPULATION_DECAY)
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
        cost, rows = self.step_cost, self.step_cost.last_rows
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": self.num_accepted_total,
            "spec_accept_rate": self.num_accepted_total / drafted if drafted else 0.0,
            "spec_pool_drafts": self.num_pool_drafts,
            # The measured step time at the latest decode step's rows and what one more row adds (0: prior)
            "spec_step_ms": 1e3 * cost.step_times(rows)[rows] if cost.measured else 0.0,
            "spec_row_ms": 1e3 * cost.row_cost(rows),
        }
