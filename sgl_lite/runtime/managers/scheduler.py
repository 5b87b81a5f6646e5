"""The scheduler: a waiting queue, a running batch, and one forward per `step()`.

Each step (SGLang 0.5.7's event loop, without overlap):
1. prefill first: the policy orders the waiting queue; the in-flight chunked request (if any) goes
   first, then `PrefillAdder` admits requests within the KV / prefill / chunk budgets, preempting
   running requests of much lower priority when priority scheduling is on;
2. else decode: one token for every running request; when free + evictable slots cannot hold one
   token each, requests are retracted (fewest decoded first) back to the queue and the new-token
   ratio is re-estimated; otherwise the ratio decays towards its minimum.
3. outputs: append tokens, check stops; prefilled prompts and finished requests' KV go into the
   radix tree. A prefill batch may share a prefix computed in that very batch (in_batch_sharing.py).

Collaborators: policy.py orders the queue, prefill_adder.py budgets admission, preemption.py picks
who gives way (retraction, priority preemption), in_batch_sharing.py finds prefixes shared within a
prefill batch, req_kv.py owns slot bookkeeping (and the accounting `check_invariant` verifies),
stop_checker.py decides finishes, validation.py validates requests before they are queued.
A request that leaves (finish, abort, retraction, preemption) gives its computed KV to the tree
(`cache_finished_req`), so a retracted or preempted request resumes from its cached prefix.

Time comes from `clock` (time.monotonic by default; Req.arrival_time must be on the same clock):
tests and the simulator (sgl_lite/sim) inject a virtual one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch, ForwardOutput, ModelRunnerBase
from sgl_lite.runtime.managers.in_batch_sharing import BatchPrefixIndex, Borrow
from sgl_lite.runtime.managers.ngram_proposer import NgramProposer
from sgl_lite.runtime.managers.policy import SchedulePolicy, prefix_match_key
from sgl_lite.runtime.managers.preemption import new_token_ratio_after_retraction, preemption_victims, retraction_order
from sgl_lite.runtime.managers.prefill_adder import AddResult, PrefillAdder, reserved_output
from sgl_lite.runtime.mem_cache.radix_cache import MatchResult
from sgl_lite.runtime.managers.req_kv import ReqKV
from sgl_lite.runtime.managers.request import FinishKind, FinishReason, Req
from sgl_lite.runtime.managers.scheduler_metrics import SchedulerMetrics, token_usage
from sgl_lite.runtime.managers.validation import QueueFullError, RequestValidator
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.runtime.managers.stop_checker import StopChecker

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
DEFAULT_NUM_DRAFT_TOKENS = 4  # --speculative-num-draft-tokens when not given


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunnerBase,
        *,
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] = (),
        context_length: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.args = args
        self.clock = clock
        self.runner = runner
        self.context_length = context_length
        self.req_to_token = runner.req_to_token
        self.num_slots: int = runner.num_slots  # type: ignore[attr-defined]
        self.kv = ReqKV(self.num_slots, self.req_to_token, args.disable_radix_cache)
        self.policy = SchedulePolicy(args, self.kv.tree_cache, clock)
        self.max_running_requests = min(args.max_running_requests or self.req_to_token.max_requests,
                                        self.req_to_token.max_requests)
        on_cuda = self.req_to_token.table.device.type == "cuda"
        chunk = args.chunked_prefill_size if args.chunked_prefill_size is not None else (8192 if on_cuda else 2048)
        self.chunk_size: int | None = None if chunk == -1 else chunk
        self.stop_checker = StopChecker(tokenizer, eos_token_ids, context_length)
        self.proposer = NgramProposer(args.speculative_num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS,
                                      args.speculative_ngram_min_match_window_size,
                                      args.speculative_ngram_max_match_window_size) \
            if args.speculative_algorithm == "ngram" else None
        self.validator = RequestValidator(args, tokenizer, runner.vocab_size, context_length, self.num_slots, eos_token_ids)

        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(MIN_NEW_TOKEN_RATIO * args.schedule_conservativeness, 1.0)
        self.new_token_ratio = self.init_new_token_ratio

        # Insertion-ordered set: O(1) removal at any queue length (order comes from the policy).
        self._waiting: dict[Req, None] = {}
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.grammar_pending: list[tuple[Req, Any]] = []  # (req, Future[GrammarMatcher])
        self.batch_is_full = False  # set when admission hit the KV budget or the running limit
        self._reports: list[Req] = []  # finished outside a forward (aborts, evictions), reported next step
        self._live: dict[str, Req] = {}

        self.num_retractions = 0
        self.num_preemptions = 0
        self.num_forward_steps = 0
        self.cached_tokens_total = 0
        self.prompt_tokens_total = 0
        self.metrics = SchedulerMetrics(args.decode_log_interval, args.log_requests, tokenizer, clock)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: Req) -> None:
        """Validate and queue `req`; ValueError (QueueFullError when full) names what is wrong."""
        if req.rid in self._live:
            raise ValueError(f"request id {req.rid!r} is already in use")
        matcher_future = self.validator.validate(req)
        if self.validator.priority_default is not None and req.priority is None:
            req.priority = self.validator.priority_default
        self._make_queue_room(req)
        req.queue_enter_time = self.clock()
        self._live[req.rid] = req
        if matcher_future is not None:
            self.grammar_pending.append((req, matcher_future))
        else:
            self._enqueue(req)
        if self.args.enable_priority_scheduling:
            self.batch_is_full = False  # a more urgent newcomer may preempt

    def _make_queue_room(self, req: Req) -> None:
        limit = self.args.max_queued_requests
        queued = len(self._waiting) + len(self.grammar_pending)
        if limit is None or queued < limit:
            return
        if self.args.enable_priority_scheduling and self._waiting:
            now, urgency = self.clock(), self.policy.urgency
            # Least urgent, newest among equals (SGLang's _abort_on_queued_limit).
            worst = max(self._waiting, key=lambda r: (urgency(r, now), r.queue_enter_time))
            if urgency(req, now) < urgency(worst, now):
                self._dequeue(worst)
                self._finish(worst, FinishReason(FinishKind.ABORT, message="The request is aborted by a higher priority request."))
                self._reports.append(worst)
                return
        raise QueueFullError(f"the request queue is full (--max-queued-requests {limit})")

    def abort_request(self, rid: str) -> bool:
        req = self._live.get(rid)
        if req is None:
            return False
        if req in self.running:
            self.running.remove(req)
            self.batch_is_full = False
        elif req is self.chunked_req:
            self.chunked_req = None
        elif req in self._waiting:
            self._dequeue(req)
        else:
            self.grammar_pending = [(r, f) for r, f in self.grammar_pending if r is not req]
            self.validator.release_grammar(req)  # a compile nobody else waits for is cancelled
        self._finish(req, FinishReason(FinishKind.ABORT, message="aborted by the client"))
        self._reports.append(req)
        return True

    def live_request_ids(self) -> list[str]:
        """Every request queued, running or awaiting its grammar (not yet finished)."""
        return list(self._live)

    def take_reports(self) -> list[Req]:
        """Finished-outside-a-forward requests (aborts, queue evictions) not yet returned by step()."""
        reports, self._reports = self._reports, []
        return reports

    def has_work(self) -> bool:
        return bool(self._waiting or self.running or self.chunked_req or self.grammar_pending or self._reports)

    def has_ready_work(self) -> bool:
        """Whether step() would do anything now: not when it would only find grammars still compiling
        (a server loop then waits instead of spinning)."""
        if self._waiting or self.running or self.chunked_req or self._reports:
            return True
        deadline = self.clock() - self.args.grammar_compile_timeout
        return any(f.done() or r.queue_enter_time < deadline for r, f in self.grammar_pending)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Req]:
        """Run at most one forward; return every request with new output or a finish since the last step."""
        changed, self._reports = self._reports, []
        self._collect_grammars(changed)
        batch, num_prefill = self._prefill_batch()
        if batch is None:
            batch = self._decode_batch(changed)
        if batch is not None:
            self.num_forward_steps += 1
            self.metrics.on_batch(self, batch, num_prefill)
            try:
                output = self.runner.forward(batch)
            except Exception as e:  # a failed forward costs the requests of its batch, not the runtime
                self._fail_batch(batch, e, changed)
            else:
                # A mixed batch (--enable-mixed-chunk) has the running requests' decode rows after its prefill rows.
                self._process_decode(batch, output, changed, start=num_prefill)
                if not batch.is_decode:
                    self._process_prefill(batch, output, changed, end=num_prefill)
        if not self.running and self.chunked_req is None:
            self.new_token_ratio = self.init_new_token_ratio
        return changed

    def _fail_batch(self, batch: ForwardBatch, error: Exception, changed: list[Req]) -> None:
        """Abort exactly the batch's requests, naming the cause. Their KV computed before this step
        is valid and goes to the tree; the slots allocated for this step go back to the free list."""
        logger.error("forward pass of %d request(s) failed; aborting them", len(batch.reqs), exc_info=error)
        self.kv.allocator.free(batch.out_cache_loc)
        failed = set(batch.reqs)
        self.running = [r for r in self.running if r not in failed]
        if self.chunked_req in failed:
            self.chunked_req = None
        message = f"forward pass failed: {type(error).__name__}: {error}"
        for req in batch.reqs:
            self._finish(req, FinishReason(FinishKind.ABORT, message=message))
            changed.append(req)
        self.batch_is_full = False

    def _collect_grammars(self, changed: list[Req]) -> None:
        still_pending = []
        budget = self.args.grammar_compile_timeout
        deadline = self.clock() - budget
        for req, future in self.grammar_pending:
            if not future.done() and req.queue_enter_time >= deadline:
                still_pending.append((req, future))
                continue
            self.validator.release_grammar(req)
            try:
                if not future.done():
                    raise ValueError(f"the grammar did not compile within --grammar-compile-timeout {budget:g} s; "
                                     "simplify it (fewer alternatives, less nesting)")
                req.grammar = future.result()
            except ValueError as e:  # the request's own grammar is at fault: a 400, not a server error
                self._finish(req, FinishReason(FinishKind.ABORT, message=str(e), error_code="bad_request"))
                changed.append(req)
                continue
            self._enqueue(req)
        self.grammar_pending = still_pending

    # ------------------------------------------------------------------ prefill

    def _prefill_batch(self) -> tuple[ForwardBatch | None, int]:
        """The next prefill batch (None: decode instead) and how many of its rows are prefill rows
        (with --enable-mixed-chunk, the running requests' decode rows follow them)."""
        if self.chunked_req is None and (not self._waiting or (self.batch_is_full and self.running)):
            return None, 0
        mixed = len(self.running) if self.args.enable_mixed_chunk else 0
        adder = PrefillAdder(self.kv.tree_cache, self.kv.allocator, self.running, self.new_token_ratio,
                             self.args.max_prefill_tokens, self.chunk_size, mixed_decode_tokens=mixed)
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        admitted = self._admit(adder)
        if not adder.plans:
            return None, 0
        return self._commit(adder, admitted, mixed), len(adder.plans)

    def _admit(self, adder: PrefillAdder) -> list[Req]:
        """Plan the waiting requests that join this prefill (in `adder`); return them, still queued."""
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
        candidates, matches = self.policy.candidates(self._waiting, limit) if self._waiting else ([], {})
        admitted: list[Req] = []
        for req in candidates:
            if adder.new_chunked_req is not None or (max_new is not None and len(adder.plans) >= max_new):
                break
            key = prefix_match_key(req)
            match = matches.get(req) or self.kv.tree_cache.match_prefix(key)
            borrow = sharing.borrow(req.fill_ids, match.length, len(key)) if sharing else None
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

    def _add_preempting(self, req: Req, match: MatchResult, borrow: Borrow | None, adder: PrefillAdder,
                        need_row: bool) -> tuple[bool, AddResult, int]:
        """`adder.add_one_req`, preempting less urgent running requests (priority scheduling) for a
        row when none is left (`need_row`) or for KV budget when it says NO_TOKEN, then trying again.

        Returns (admitted, budget state, running requests preempted).
        """
        freed = 0
        if need_row:
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

    # ------------------------------------------------------------------ decode

    def _decode_batch(self, changed: list[Req]) -> ForwardBatch | None:
        if not self.running:
            return None
        if not self.kv.ensure_free(len(self.running)):
            self._retract(changed)
            if not self.running:
                return None
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, self.min_new_token_ratio)
        drafts = self._drafts() if self.proposer is not None else None
        if drafts is None or not any(drafts):
            return self.kv.build_batch([(r, 1) for r in self.running], is_decode=True)
        return self.kv.build_batch([(r, 1 + len(d)) for r, d in zip(self.running, drafts)], is_decode=False, drafts=drafts)

    def _drafts(self) -> list[list[int]] | None:
        """N-gram drafts for the running requests ([] where a request does not draft), or None when
        the free slots cannot hold them: drafts never evict cached prefixes."""
        assert self.proposer is not None
        drafts = []
        for req in self.running:
            params = req.sampling_params
            # Requests whose next-token distribution depends on the tokens before it in ways the
            # verifier does not replay (grammar state, penalties, min_new_tokens) decode one token a step.
            plain = (req.grammar is None and len(req.output_ids) >= params.min_new_tokens
                     and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
                     and params.repetition_penalty == 1.0)
            # Room for every accepted token plus the one after: within max_new_tokens and the context.
            limit = min(params.max_new_tokens - len(req.output_ids), self.context_length - req.seq_len) - 1
            drafts.append(self.proposer.propose(req, limit) if plain and limit > 0 else [])
        if len(self.running) + sum(map(len, drafts)) > self.kv.allocator.available_size:
            return None
        return drafts

    def _retract(self, changed: list[Req]) -> None:
        """SGLang's retract_decode: put back the requests with the fewest outputs (then longest prompts)."""
        order = retraction_order(self.running)
        retracted: list[Req] = []
        while not self.kv.ensure_free(len(order)):
            if len(order) == 1:
                if self.chunked_req is not None:
                    chunked, self.chunked_req = self.chunked_req, None
                    self._requeue(chunked)
                    chunked.num_retractions += 1
                    self.num_retractions += 1
                    continue
                lone = order.pop()
                self._finish(lone, FinishReason(
                    FinishKind.ABORT,
                    message=f"out of KV cache memory: {lone.seq_len} tokens need more than the "
                            f"{self.num_slots}-slot pool (raise --max-total-tokens)"))
                changed.append(lone)
                break
            victim = order.pop()
            self._requeue(victim)
            victim.num_retractions += 1
            retracted.append(victim)
        kept = set(order)
        self.running = [r for r in self.running if r in kept]
        self.num_retractions += len(retracted)
        self.batch_is_full = False
        self.new_token_ratio = new_token_ratio_after_retraction(self.running)
        logger.debug("retracted %d request(s); new_token_ratio %.3f", len(retracted), self.new_token_ratio)

    def _process_decode(self, batch: ForwardBatch, output: ForwardOutput, changed: list[Req], start: int = 0) -> None:
        """Rows [start, end of batch) (decode rows: one new token each, all in self.running)."""
        for i in range(start, len(batch.reqs)):
            req = batch.reqs[i]
            accepted = output.accepted_ids[i] if batch.draft_ids and batch.draft_ids[i] else None
            if accepted is None:
                req.kv_len += 1
                self._append_token(req, output.next_token_ids[i])
            else:
                self._append_verified(req, accepted, batch.extend_lens[i])
            changed.append(req)
        if any(r.finished for r in self.running):
            self.running = [r for r in self.running if not r.finished]
            self.batch_is_full = False

    # ------------------------------------------------------------------ shared helpers

    def _append_token(self, req: Req, token: int | None) -> None:
        reason = self._take_token(req, token)
        if reason is not None:
            self._finish(req, reason)

    def _take_token(self, req: Req, token: int | None) -> FinishReason | None:
        """Append one output token; the reason the request must finish now, if any."""
        assert token is not None, f"the runner returned no token for {req.rid}"
        req.output_ids.append(int(token))
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        if req.grammar is not None and not req.grammar.accept_token(int(token)):
            # The sampler applies the grammar mask, so this means a masking bug; SGLang aborts too.
            return FinishReason(FinishKind.ABORT, message=f"the grammar rejected sampled token {token}")
        return self.stop_checker.check(req)

    def _append_verified(self, req: Req, tokens: list[int], extend: int) -> None:
        """A verified draft row: `extend` slots were computed (its last token + the draft); append the
        accepted tokens up to the first stop, keep the KV of the tokens kept, free the other slots."""
        assert self.proposer is not None
        self.proposer.record(req, extend - 1, len(tokens) - 1)
        req.spec_verify_ct += 1
        start, reason, kept = req.kv_len, None, 0
        for token in tokens:
            kept += 1
            reason = self._take_token(req, token)
            if reason is not None:
                break
        # Position start + j holds the KV of the j-th input of this row, valid while that input is
        # the request's: its last token and the accepted draft tokens before the last one kept.
        req.kv_len = start + kept
        if kept < extend:
            row = self.req_to_token.table[req.req_pool_idx]
            self.kv.allocator.free(row[start + kept : start + extend].clone())
        if kept < len(tokens) and req.return_logprob:  # the runner scored every verified token
            del req.output_token_logprobs[kept - len(tokens):]
            del req.output_top_logprobs[kept - len(tokens):]
        if reason is not None:
            self._finish(req, reason)

    def _requeue(self, req: Req) -> None:
        """Retraction / preemption: back to the queue (bypassing its limit), resuming from the cache."""
        self.kv.release(req)
        if req.return_logprob:
            req.input_token_logprobs.clear()  # the re-prefill scores the prompt again
        req.queue_enter_time = self.clock()
        self._enqueue(req)

    @property
    def waiting(self) -> list[Req]:
        """The waiting requests in queue-entry order (a copy; the policy decides the service order)."""
        return list(self._waiting)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def _enqueue(self, req: Req) -> None:
        self._waiting[req] = None
        self.policy.on_enqueue(req)

    def _dequeue(self, req: Req) -> None:
        del self._waiting[req]
        self.policy.on_dequeue(req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        self.kv.release(req)
        self._live.pop(req.rid, None)
        self.metrics.on_finish(req)

    # ------------------------------------------------------------------ maintenance

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        self.kv.flush()
        return True

    def check_invariant(self) -> None:
        """AssertionError unless every slot and row is accounted for (and, when idle, none is in use)."""
        self.kv.tree_cache.check_integrity()
        index = self.policy.index
        if index is not None:
            assert set(index.entries) == set(self._waiting), "the waiting index and the queue differ"
            index.check()
        error = self.kv.accounting_error(self._live.values())
        assert error is None, error
        if not self.has_work():
            assert not self._live, f"idle but requests are live: {list(self._live)}"
            assert self.kv.tree_cache.protected_size() == 0, "idle but slots are locked in the radix tree"
            assert self.req_to_token.available_size == self.req_to_token.max_requests, "idle but a row is in use"
        for req in self.running:
            assert req.kv_len == req.seq_len - 1, f"{req.rid}: running with kv_len {req.kv_len}, seq_len {req.seq_len}"

    def stats(self) -> dict[str, Any]:
        prompt = self.prompt_tokens_total
        used, usage = token_usage(self)
        return {
            "num_waiting": len(self._waiting),
            "num_running": len(self.running),
            "num_chunked": int(self.chunked_req is not None),
            "num_grammar_pending": len(self.grammar_pending),
            "slots_total": self.num_slots,
            "slots_free": self.kv.allocator.available_size,
            "slots_evictable": self.kv.tree_cache.evictable_size(),
            "slots_protected": self.kv.tree_cache.protected_size(),
            "cached_tokens_total": self.cached_tokens_total,
            "prompt_tokens_total": prompt,
            "cache_hit_rate": self.cached_tokens_total / prompt if prompt else 0.0,
            "num_retractions": self.num_retractions,
            "num_preemptions": self.num_preemptions,
            "num_forward_steps": self.num_forward_steps,
            "num_used_tokens": used,
            "token_usage": usage,
            "gen_throughput": self.metrics.gen_throughput,
            "generated_tokens_total": self.metrics.generated_tokens_total,
            "num_finished_requests": self.metrics.finished_requests_total,
            "num_aborted_requests": self.metrics.aborted_requests_total,
            "new_token_ratio": self.new_token_ratio,
            "schedule_policy": self.policy.policy,
            "max_running_requests": self.max_running_requests,
            "chunked_prefill_size": self.chunk_size,
            **(self.proposer.stats() if self.proposer is not None else {}),
        }

