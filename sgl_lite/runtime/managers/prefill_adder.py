"""Prefill admission: which waiting requests join this round's prefill batch, and how many tokens each.

SGLang 0.5.7's `PrefillAdder`, page size 1. Budgets, all in tokens:
- rem_total_tokens = free + evictable - (reserved output of running requests, scaled by the
  new-token ratio) - (input + reserved output of requests admitted this round). A request is
  admitted only when its input + min(max_new_tokens, CLIP) is below it (NO_TOKEN otherwise).
- cur_rem_tokens = free + evictable - inputs admitted this round: what the allocation can still get.
- rem_input_tokens = --max-prefill-tokens; a request that would exhaust it joins only an empty batch.
- rem_chunk_tokens = --chunked-prefill-size; a request longer than what is left is truncated to
  that and becomes the (single) chunked request, which ends the round.
- chunk_cap (sgl_lite's, fair prefill's pacing, prefill_pacing.py; None: no cap): a chunk is also cut
  to the cap less the prefill tokens planned before it this round (mixed decode rows not counted, so
  a chunk that goes first always gets the whole cap). Prompts that fit whole are not cut by it.

A request admitted here has its matched prefix locked (inc_lock_ref) at once, so the evictable
size the next request sees already excludes it. The scheduler unlocks on release.

One sgl_lite addition: a request that would run alone (nothing running, nothing admitted, no
chunk in flight) skips the output reservation check, so that a request whose prompt fits the pool
is never starved by a reservation no one else holds (SGLang can wait on it for ever).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from sgl_lite.runtime.managers.in_batch_sharing import Borrow
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.memory_pool import SlotAllocator
from sgl_lite.runtime.mem_cache.radix_cache import MatchResult, RadixCache

# SGLang's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: reservations assume at most this many new tokens.
CLIP_MAX_NEW_TOKENS = 4096


class AddResult(enum.Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"  # out of KV budget: the running batch counts as full
    OTHER = "other"  # out of prefill-batch budget (input or chunk tokens)


@dataclass
class PlannedExtend:
    req: Req
    # New admissions: the cached prefix to start from (locked). None for the in-flight chunked request.
    match: MatchResult | None
    # Tokens after the prefix this round covers: the first `borrow.length` read an earlier plan's KV
    # (in-batch prefix sharing), the rest are computed.
    extend_len: int
    borrow: Borrow | None = None


def remaining_output(req: Req) -> int:
    return max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)


def computed_tokens(req: Req, match: MatchResult, borrow: Borrow | None) -> int:
    """The prompt tokens an admission computes: neither cached (`match`) nor borrowed in the batch."""
    return req.seq_len - match.length - (borrow.length if borrow is not None else 0)


def reserved_output(req: Req, new_token_ratio: float) -> float:
    """What the budget holds back for a running request's future tokens."""
    return min(remaining_output(req), CLIP_MAX_NEW_TOKENS) * new_token_ratio


class PrefillAdder:
    def __init__(
        self,
        tree_cache: RadixCache,
        allocator: SlotAllocator,
        running: Sequence[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunk_size: int | None,
        mixed_decode_tokens: int = 0,
        chunk_cap: int | None = None,
    ) -> None:
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.new_token_ratio = new_token_ratio
        # Decode tokens riding in the same forward (--enable-mixed-chunk) use the same budgets.
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = chunk_size - mixed_decode_tokens if chunk_size is not None else None
        self.rem_total_offset = sum(reserved_output(r, new_token_ratio) for r in running)
        self.cur_rem_offset = mixed_decode_tokens
        self.chunk_cap = chunk_cap
        self.prefill_tokens = 0  # computed by this round's prefill rows so far
        self.plans: list[PlannedExtend] = []
        self.new_chunked_req: Req | None = None

    # ------------------------------------------------------------------ budgets

    def _available_and_evictable(self) -> int:
        return self.allocator.available_size + self.tree_cache.evictable_size()

    @property
    def rem_total_tokens(self) -> float:
        return self._available_and_evictable() - self.rem_total_offset

    @property
    def cur_rem_tokens(self) -> int:
        return self._available_and_evictable() - self.cur_rem_offset

    def budget_state(self) -> AddResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddResult.OTHER
        return AddResult.CONTINUE

    def _update_budget(self, extend_len: int, reserved_new_tokens: int) -> None:
        self.rem_total_offset += extend_len + reserved_new_tokens
        self.cur_rem_offset += extend_len
        self.rem_input_tokens -= extend_len
        self.prefill_tokens += extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len

    def _chunk_room(self) -> int:
        """The most tokens a chunk may take now: memory, the chunk budget, and the pacing cap."""
        room = self.cur_rem_tokens
        if self.rem_chunk_tokens is not None:
            room = min(room, self.rem_chunk_tokens)
        if self.chunk_cap is not None:
            room = min(room, self.chunk_cap - self.prefill_tokens)
        return room

    def release_running(self, req: Req) -> None:
        """A running request was preempted: its output reservation is no longer held."""
        self.rem_total_offset -= reserved_output(req, self.new_token_ratio)

    # ------------------------------------------------------------------ admission

    def add_chunked_req(self, req: Req) -> None:
        """The in-flight chunked request goes first; it takes what the chunk budget and memory allow."""
        remaining = req.seq_len - req.kv_len
        n = min(remaining, self._chunk_room())
        if n <= 0:
            self.new_chunked_req = req  # still in flight; no memory this round, decode or retraction frees some
            return
        self.plans.append(PlannedExtend(req, None, n))
        last_chunk = n == remaining
        self._update_budget(n, min(remaining_output(req), CLIP_MAX_NEW_TOKENS) if last_chunk else 0)
        if not last_chunk:
            self.new_chunked_req = req

    def add_one_req(self, req: Req, match: MatchResult, alone: bool, borrow: Borrow | None = None) -> tuple[bool, AddResult]:
        """Try to admit `req` starting from `match` (then `borrow`); returns (admitted, budget state).

        Borrowed tokens cost no slot and no compute: only the computed ones count against the budgets.
        """
        borrowed = borrow.length if borrow is not None else 0
        extend_len = computed_tokens(req, match, borrow)
        total_tokens = extend_len + min(remaining_output(req), CLIP_MAX_NEW_TOKENS)
        if not alone and total_tokens >= self.rem_total_tokens:
            return False, AddResult.NO_TOKEN
        if self.over_input_budget(req, match, borrow):
            return False, AddResult.OTHER
        self.tree_cache.inc_lock_ref(match.last_node)
        # Locking turned part of the evictable size protected: check again.
        if not alone and total_tokens >= self.rem_total_tokens:
            self.tree_cache.dec_lock_ref(match.last_node)
            return False, AddResult.NO_TOKEN
        if self.rem_chunk_tokens is None or extend_len <= self.rem_chunk_tokens:
            if extend_len > self.cur_rem_tokens:
                self.tree_cache.dec_lock_ref(match.last_node)
                return False, AddResult.NO_TOKEN
            self.plans.append(PlannedExtend(req, match, borrowed + extend_len, borrow))
            self._update_budget(extend_len, min(remaining_output(req), CLIP_MAX_NEW_TOKENS))
        else:
            chunk = self._chunk_room()
            if chunk <= 0:
                self.tree_cache.dec_lock_ref(match.last_node)
                return False, AddResult.OTHER
            self.plans.append(PlannedExtend(req, match, borrowed + chunk, borrow))
            self.new_chunked_req = req
            self._update_budget(chunk, 0)
        return True, self.budget_state()

    def over_input_budget(self, req: Req, match: MatchResult, borrow: Borrow | None = None) -> bool:
        """Whether add_one_req refuses `req` this round for its input budget (OTHER), whatever is freed."""
        return bool(self.plans) and computed_tokens(req, match, borrow) >= self.rem_input_tokens

    def tokens_short(self, req: Req, match: MatchResult, borrow: Borrow | None = None) -> float:
        """How many more budget tokens `req` needs to pass add_one_req's NO_TOKEN checks (<= 0: none):
        the second one, after its match is locked, when the match no longer counts as evictable."""
        total_tokens = computed_tokens(req, match, borrow) + min(remaining_output(req), CLIP_MAX_NEW_TOKENS)
        return total_tokens - (self.rem_total_tokens - self.tree_cache.unlocked_length(match.last_node)) + 1
