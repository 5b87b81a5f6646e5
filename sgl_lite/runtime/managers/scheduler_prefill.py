"""The prefill half of the Scheduler's step: admission into a prefill batch, and its outputs.

`PrefillScheduling` is a mixin of `Scheduler` (scheduler.py), which owns every attribute it reads and
writes; it is split out only to keep one step's two halves readable. Per step, `_prefill_batch` asks the
policy for candidates, admits them through `PrefillAdder` within the KV / prefill / chunk / row budgets
(preempting less urgent running requests under priority scheduling, and letting a request borrow a
prefix computed earlier in the same batch), then allocates their slots. After the forward,
`_process_prefill` advances each row, puts prefilled prompts into the radix tree and starts decoding.

Fair prefill (sgl_lite's, off with --disable-fair-prefill): while a long prompt is chunked, it no
longer holds every step. Its prefill rounds alternate between SGLang's (the chunk first, with the
whole chunk budget) and shared rounds (also the next round after a request is queued, up to two in a
row: `PrefillTurns`), where the waiting requests whose whole remaining prompt fits
the chunk budget go first, in policy order, skipping those that would need chunking themselves (only
one prompt is chunked at a time), and the chunk takes what is left (while chunks are sized by time, only
MIN_CHUNK_TOKENS beside requests taken in: their round lasts about their own prefill). And a decode step of the running
requests follows every prefill round that leaves a prompt longer than a chunk still chunked (unless
--enable-mixed-chunk runs their decode inside it). So a short request that arrives behind any number
of long prompts is prefilled in the next prefill round (the one after, when two shared rounds just ran),
and running requests keep decoding, while the long prompt still gets at least every third round
(docs/scheduling.md, section 6). While someone else runs or waits, a chunk also takes no more tokens than the measured prefill rate computes in a target
step time (prefill_pacing.py, PrefillAdder's `chunk_cap`), so a round is short on a slow or loaded machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sgl_lite.runtime.managers.in_batch_sharing import BatchPrefixIndex, Borrow
from sgl_lite.runtime.managers.policy import prefix_match_key
from sgl_lite.runtime.managers.preemption import preemption_victims
from sgl_lite.runtime.managers.prefill_adder import AddResult, PrefillAdder, computed_tokens, reserved_output
from sgl_lite.runtime.managers.prefill_pacing import MIN_CHUNK_TOKENS
from sgl_lite.runtime.managers.request import FinishKind, FinishReason, Req
from sgl_lite.runtime.mem_cache.radix_cache import MatchResult
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch, ForwardOutput

if TYPE_CHECKING:
    from sgl_lite.runtime.managers.scheduler import Scheduler

    _Base = Scheduler
else:
    _Base = object

logger = logging.getLogger("sgl_lite.runtime.managers.scheduler")

# How deep a shared round looks into the waiting queue for requests that fit whole: each look is one
# radix match, and two full-fanout HTTP batches (--max-request-fanout 256) of long prompts fit in it.
SHARED_ROUND_SCAN = 512


# Shared rounds in a row that newcomers may ask for before the chunk gets a round of its own.
MAX_SHARED_IN_A_ROW = 2


@dataclass
class PrefillTurns:
    """Fair prefill's turns while a prompt is chunked (module docstring): rounds alternate, and a request
    queued since the last shared round makes the next round shared too (it need not wait behind a
    chunk-first round), up to MAX_SHARED_IN_A_ROW in a row, so a stream of newcomers cannot hold the
    chunk to what they leave of the shared rounds."""

    shared_next: bool = False  # the next prefill round with a chunk in flight is a shared round
    decode_next: bool = False  # the next step decodes the running requests
    queued_since_shared: bool = False  # a request was queued while a chunk was in flight, since the last shared round
    shared_in_a_row: int = 0

    def take_shared_round(self) -> bool:
        shared = self.shared_next or (self.queued_since_shared and self.shared_in_a_row < MAX_SHARED_IN_A_ROW)
        self.shared_in_a_row = self.shared_in_a_row + 1 if shared else 0
        self.shared_next = not shared
        if shared:
            self.queued_since_shared = False
        return shared


class PrefillScheduling(_Base):
    def _prefill_batch(self) -> tuple[ForwardBatch | None, int]:
        """The next prefill batch (None: decode instead) and how many of its rows are prefill rows
        (with --enable-mixed-chunk, the running requests' decode rows follow them)."""
        turns = self.prefill_turns
        if turns is not None and turns.decode_next:
            turns.decode_next = False
            if self.running:
                return None, 0
        if self.chunked_req is None and (not self._waiting or (self.batch_is_full and self.running)):
            return None, 0
        mixed = len(self.running) if self.args.enable_mixed_chunk else 0
        # Someone to be fair to: a request besides the one chunked (or about to be) runs or waits.
        others = bool(self.running) or len(self._waiting) + (self.chunked_req is not None) >= 2
        cap = self.prefill_pacer.chunk_cap(others) if self.prefill_pacer is not None else None
        adder = PrefillAdder(self.kv.tree_cache, self.kv.allocator, self.running, self.new_token_ratio,
                             self.args.max_prefill_tokens, self.chunk_size, mixed_decode_tokens=mixed, chunk_cap=cap)
        shared = turns is not None and self.chunked_req is not None and bool(self._waiting) and turns.take_shared_round()
        if self.chunked_req is not None and not shared:
            adder.add_chunked_req(self.chunked_req)
        admitted = self._admit(adder, whole_only=shared)
        if shared:
            if admitted and cap is not None:
                # A round that takes in waiting requests stays short, so their first tokens come out after
                # their own prefill rather than a whole paced step: the chunk rides along with a floor.
                adder.chunk_cap = adder.prefill_tokens + MIN_CHUNK_TOKENS
            adder.add_chunked_req(self.chunked_req)  # after the waiting requests: it takes what they left
        if not adder.plans:
            return None, 0
        if turns is not None:
            # A prompt longer than a chunk holds several rounds: the running requests decode between them.
            chunked = adder.new_chunked_req
            turns.decode_next = chunked is not None and chunked.seq_len > (self.chunk_size or 0) and not mixed
        return self._commit(adder, admitted, mixed), len(adder.plans)

    def _admit(self, adder: PrefillAdder, whole_only: bool = False) -> list[Req]:
        """Plan the waiting requests that join this prefill (in `adder`); return them, still queued.

        `whole_only` (a shared round, a prompt is being chunked): only requests whose whole remaining
        prompt fits the budgets join, looked for up to SHARED_ROUND_SCAN deep in policy order.
        """
        sharing = None
        if not self.kv.tree_cache.disable and not self.args.disable_in_batch_prefix_sharing:
            sharing = BatchPrefixIndex()
            for i, plan in enumerate(adder.plans):  # the chunked request lends what it holds
                sharing.add(plan.req.fill_ids, plan.req.kv_len + plan.extend_len, i)
        rows_left = self.max_running_requests - len(self.running) - (self.chunked_req is not None)
        max_new = self.args.prefill_max_requests
        # Admission stops at the first request it cannot take (or one past the row limit, when no
        # preemption can make room), so the policy need not order more than this.
        limit = max(min(rows_left, max_new if max_new is not None else rows_left), 0) + 1
        if whole_only:
            limit = max(limit, SHARED_ROUND_SCAN)
        candidates, matches = self.policy.candidates(self._waiting, limit) if self._waiting else ([], {})
        if whole_only and self.args.enable_priority_scheduling:
            # The queue is in urgency order: only requests as urgent as the chunked one share its rounds.
            now = self.policy.clock()
            chunk_urgency = self.policy.urgency(self.chunked_req, now)
            candidates = [r for r in candidates[:limit] if self.policy.urgency(r, now) <= chunk_urgency]
        admitted: list[Req] = []
        for req in candidates[:limit] if whole_only else candidates:
            if adder.new_chunked_req is not None or (max_new is not None and len(adder.plans) >= max_new):
                break
            key = prefix_match_key(req)
            if whole_only and req not in matches and not self._may_fit_whole(req, key, adder):
                continue
            match = matches.get(req) or self.kv.tree_cache.match_prefix(key)
            borrow = sharing.borrow(req.fill_ids, match.length, len(key)) if sharing else None
            if whole_only and (computed_tokens(req, match, borrow) > (adder.rem_chunk_tokens or 0)
                               or adder.over_input_budget(req, match, borrow)):
                continue  # it would need chunking, or more than this round's input budget: a later round
            ok, result, freed = self._add_preempting(req, match, borrow, adder, need_row=len(admitted) >= rows_left)
            rows_left += freed
            if ok:
                admitted.append(req)
                if sharing is not None:
                    sharing.add(req.fill_ids, match.length + adder.plans[-1].extend_len, len(adder.plans) - 1)
            if result is not AddResult.CONTINUE:
                if result is AddResult.NO_TOKEN:
                    self.batch_is_full = True
                break
        return admitted

    def _may_fit_whole(self, req: Req, key: list[int], adder: PrefillAdder) -> bool:
        """False when `req` cannot fit the chunk budget whole, known without a radix match: its prompt is
        longer than the budget and the tree holds nothing that starts like it (one dict lookup)."""
        if req.seq_len - req.kv_len <= (adder.rem_chunk_tokens or 0) or not key:
            return True
        return key[0] in self.kv.tree_cache.root_node.children

    def _add_preempting(self, req: Req, match: MatchResult, borrow: Borrow | None, adder: PrefillAdder,
                        need_row: bool) -> tuple[bool, AddResult, int]:
        """`adder.add_one_req`, preempting less urgent running requests (priority scheduling) for a
        row when none is left (`need_row`) or for KV budget when it says NO_TOKEN, then trying again.

        Returns (admitted, budget state, running requests preempted).
        """
        freed = 0
        if need_row:
            if adder.over_input_budget(req, match, borrow):  # a row would not admit it this round
                return False, AddResult.OTHER, 0
            freed = self._preempt_for(req, match, borrow, adder, need_row=True)
            if not freed:
                return False, AddResult.NO_TOKEN, 0
        alone = not self.running and not adder.plans and self.chunked_req is None
        ok, result = adder.add_one_req(req, match, alone, borrow)
        if not ok and result is AddResult.NO_TOKEN:
            more = self._preempt_for(req, match, borrow, adder, need_row=False)
            if more:
                freed += more
                ok, result = adder.add_one_req(req, match, alone, borrow)
        return ok, result, freed

    def _commit(self, adder: PrefillAdder, admitted: list[Req], mixed: int) -> ForwardBatch:
        """Take the planned requests out of the queue, give them rows and build the batch."""
        admission_time = self.clock()
        for req in admitted:
            self._dequeue(req)
            req.admission_time = admission_time
        for plan in adder.plans:
            if plan.match is not None:
                self.kv.start(plan.req, plan.match)
        borrows = [plan.borrow for plan in adder.plans]
        for plan, borrow in zip(adder.plans, borrows):
            if plan.match is not None and plan.req.num_retractions == 0 and plan.req.num_preemptions == 0:
                # Borrowed tokens count as cached: their KV is reused, not computed for this request.
                cached = plan.match.length + (borrow.length if borrow is not None else 0)
                plan.req.cached_tokens = cached
                self.cached_tokens_total += cached
                self.prompt_tokens_total += len(plan.req.input_ids)
        # Preemption may have shrunk `running` since the adder reserved room for `mixed` decode tokens.
        decodes = [(r, 1) for r in self.running] if mixed else []
        return self.kv.build_batch([(p.req, p.extend_len) for p in adder.plans] + decodes, is_decode=False,
                                   borrows=borrows + [None] * len(decodes))

    def _preempt_for(self, req: Req, match: MatchResult, borrow: Borrow | None, adder: PrefillAdder,
                     need_row: bool) -> int:
        """Preempt as few running requests as admit `req`, each less urgent by MORE than the threshold.

        Returns how many were preempted (0: none, and nothing changed).
        """
        if not self.args.enable_priority_scheduling or not self.running:
            return 0
        now = self.clock()
        victims = preemption_victims(
            self.running, self.policy.urgency(req, now), lambda r: self.policy.urgency(r, now),
            self.args.priority_scheduling_preemption_threshold, adder.tokens_short(req, match, borrow), need_row,
            lambda r: reserved_output(r, adder.new_token_ratio) + (r.kv_len - r.prefix_len))
        if not victims:
            return 0
        for r in victims:
            self.running.remove(r)
            adder.release_running(r)
            self._requeue(r)
            r.num_preemptions += 1
            self.num_preemptions += 1
        logger.debug("preempted %d request(s) for %s", len(victims), req.rid)
        return len(victims)

    def _process_prefill(self, batch: ForwardBatch, output: ForwardOutput, changed: list[Req], end: int) -> None:
        """Rows [0, end) of `batch` (the prefill rows)."""
        # What this batch leaves in the tree or frees can change what fits: look at the queue again.
        self.batch_is_full = False
        for i in range(end):
            req = batch.reqs[i]
            # Tokens read from an earlier request of this batch (in-batch sharing): not this one's slots.
            borrowed = batch.prefix_lens[i] - req.kv_len
            req.kv_len = batch.prefix_lens[i] + batch.extend_lens[i]
            if req.kv_len < req.seq_len:
                self.kv.tree_cache.cache_unfinished_req(req, borrowed)
                self.kv.write_chunk(req)
                self.chunked_req = req
                continue
            # The prompt goes into the tree now (as in SGLang), so requests arriving while this one
            # decodes can reuse it. Batch order puts in-batch lenders in before their borrowers, so
            # a borrower's lock moves onto the path holding what it read, and its row onto the tree's
            # slots there (a lender may have freed its own copy as a duplicate of a newer tree entry).
            self.kv.tree_cache.cache_unfinished_req(req, borrowed)
            if self.chunked_req is req:
                self.chunked_req = None
            if not req.wants_sampling:  # a prefill-only cache hint
                self._finish(req, FinishReason(FinishKind.LENGTH))
                changed.append(req)
                continue
            self._append_token(req, output.next_token_ids[i])
            changed.append(req)
            if not req.finished:
                self.running.append(req)
