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

The step's two halves live in scheduler_prefill.py (admission, prefill outputs) and
scheduler_decode.py (retraction, speculative drafts, decode outputs), mixins of this class.
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

from sgl_lite.runtime.managers.policy import SchedulePolicy
from sgl_lite.runtime.managers.prefill_pacing import PrefillPacer
from sgl_lite.runtime.managers.req_kv import ReqKV
from sgl_lite.runtime.managers.request import ABORTED_BY_CLIENT, FinishKind, FinishReason, Req
from sgl_lite.runtime.managers.scheduler_decode import DecodeScheduling
from sgl_lite.runtime.managers.scheduler_metrics import SchedulerMetrics, scheduler_stats
from sgl_lite.runtime.managers.scheduler_prefill import PrefillScheduling, PrefillTurns
from sgl_lite.runtime.managers.stop_checker import StopChecker
from sgl_lite.runtime.managers.tier_loads import TierLoads
from sgl_lite.runtime.managers.validation import QueueFullError, RequestValidator
from sgl_lite.runtime.mem_cache.hicache.tier import KVTier
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch, ModelRunnerBase
from sgl_lite.runtime.sampling.jump_forward import JumpForward
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.runtime.speculative.ngram_layout import layout_free_keys
from sgl_lite.runtime.speculative.ngram_proposer import NgramProposer

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1


class Scheduler(PrefillScheduling, DecodeScheduling):
    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunnerBase,
        *,
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] = (),
        context_length: int,
        clock: Callable[[], float] = time.monotonic,
        tier: KVTier | None = None,
    ) -> None:
        """`tier`: the disk tier under the radix tree (--enable-hierarchical-cache), None without one."""
        self.args = args
        self.clock = clock
        self.runner = runner
        self.context_length = context_length
        self.req_to_token = runner.req_to_token
        self.num_slots: int = runner.num_slots  # type: ignore[attr-defined]
        self.kv = ReqKV(self.num_slots, self.req_to_token, args.disable_radix_cache, tier)
        self.policy = SchedulePolicy(args, self.kv.tree_cache, clock)
        self.max_running_requests = min(args.max_running_requests or self.req_to_token.max_requests,
                                        self.req_to_token.max_requests)
        on_cuda = self.req_to_token.table.device.type == "cuda"
        chunk = args.chunked_prefill_size if args.chunked_prefill_size is not None else (8192 if on_cuda else 2048)
        self.chunk_size: int | None = None if chunk == -1 else chunk
        self.stop_checker = StopChecker(tokenizer, eos_token_ids, context_length)
        # SGLang's default: as many draft tokens as the longest match window.
        self.proposer = NgramProposer(args.speculative_num_draft_tokens or args.speculative_ngram_max_match_window_size,
                                      args.speculative_ngram_min_match_window_size,
                                      args.speculative_ngram_max_match_window_size, args.speculative_ngram_capacity,
                                      layout_free_keys(tokenizer, runner.vocab_size)) \
            if args.speculative_algorithm == "ngram" else None
        # Jump-forward decoding of grammar-forced text (scheduler_decode.py); it needs the tokenizer.
        self.jump_forward = JumpForward(tokenizer) \
            if tokenizer is not None and not args.disable_regex_jump_forward else None
        self.validator = RequestValidator(args, tokenizer, runner.vocab_size, context_length, self.num_slots, eos_token_ids)

        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(MIN_NEW_TOKEN_RATIO * args.schedule_conservativeness, 1.0)
        self.new_token_ratio = self.init_new_token_ratio

        # Insertion-ordered set: O(1) removal at any queue length (order comes from the policy).
        self._waiting: dict[Req, None] = {}
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.prefill_turns = None if args.disable_fair_prefill else PrefillTurns()
        # Chunks sized by the measured prefill rate (prefill_pacing.py); not under deterministic inference,
        # whose batch shapes would then vary with the machine's load.
        self.prefill_pacer = PrefillPacer(self.chunk_size) if self.chunk_size is not None and not (
            args.disable_fair_prefill or args.enable_deterministic_inference) else None
        self.grammar_pending: list[tuple[Req, Any]] = []  # (req, Future[GrammarMatcher])
        # Requests whose prefix is being loaded from the disk tier before they queue (tier_loads.py).
        self.tier_loads = TierLoads(tier, self.kv, lambda: bool(self.running or self.chunked_req)) if tier is not None else None
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
        try:
            self._make_queue_room(req)
        except QueueFullError:
            if matcher_future is not None:
                self.validator.release_grammar(req)  # else its compile would run, and be kept, for nobody
            raise
        req.queue_enter_time = self.clock()
        self._live[req.rid] = req
        if matcher_future is not None:
            self.grammar_pending.append((req, matcher_future))
        else:
            self._queue_or_load(req)
        if self.args.enable_priority_scheduling:
            self.batch_is_full = False  # a more urgent newcomer may preempt

    def _make_queue_room(self, req: Req) -> None:
        limit = self.args.max_queued_requests
        queued = len(self._waiting) + len(self.grammar_pending) + len(self.tier_loads or ())
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

    def abort_request(self, rid: str, by_client: bool = False) -> bool:
        """End a live request (False if unknown). `by_client`: its client asked, so its output so far is
        its answer (FinishReason.error_code None); else the abort is an error to whoever waits for it."""
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
        elif any(r is req for r, _ in self.grammar_pending):
            self.grammar_pending = [(r, f) for r, f in self.grammar_pending if r is not req]
            self.validator.release_grammar(req)  # a compile nobody else waits for is cancelled
        elif self.tier_loads is not None and self.tier_loads.cancel(req):
            pass  # its load is dropped and its prefix unlocked
        # else: in no queue, after a step that raised between dequeuing it and running it (its grammar,
        # if any, was released when it left grammar_pending)
        self._finish(req, FinishReason(FinishKind.ABORT, message=ABORTED_BY_CLIENT, error_code=None if by_client else "aborted"))
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
        return bool(self._waiting or self.running or self.chunked_req or self.grammar_pending or self._reports
                    or (self.tier_loads is not None and self.tier_loads.has_work()))

    def has_ready_work(self) -> bool:
        """Whether step() would do anything now: not when it would only find grammars still compiling
        (a server loop then waits instead of spinning)."""
        if self._waiting or self.running or self.chunked_req or self._reports:
            return True
        if self.tier_loads is not None and self.tier_loads.any_ready():
            return True
        deadline = self.clock() - self.args.grammar_compile_timeout
        return any(f.done() or r.queue_enter_time < deadline for r, f in self.grammar_pending)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Req]:
        """Run at most one forward; return every request with new output or a finish since the last step.
        When it raises, what it had to report so far is reported by the next step (or take_reports)."""
        changed, self._reports = self._reports, []
        try:
            self._step(changed)
        except BaseException:
            self._reports = changed + self._reports
            raise
        return changed

    def _step(self, changed: list[Req]) -> None:
        self._collect_grammars(changed)
        if self.tier_loads is not None:
            for req in self.tier_loads.collect():
                self._enqueue(req)
        batch, num_prefill = self._prefill_batch()
        if batch is None:
            batch = self._decode_batch(changed)
        if batch is not None:
            self.num_forward_steps += 1
            self.metrics.on_batch(self, batch, num_prefill)
            start, clock_start = time.perf_counter(), self.clock()
            try:
                output = self.runner.forward(batch)
            except Exception as e:  # a failed forward costs the requests of its batch, not the runtime
                self._fail_batch(batch, e, changed)
            else:
                if num_prefill == 0 and self.proposer is not None:  # the draft-length policy's step costs
                    self.proposer.step_cost.record(batch.num_tokens, time.perf_counter() - start)
                if num_prefill and self.prefill_pacer is not None:  # on the clock: the simulator's is virtual
                    self.prefill_pacer.rate.record(batch.num_tokens, self.clock() - clock_start)
                # A mixed batch (--enable-mixed-chunk) has the running requests' decode rows after its prefill rows.
                self._process_decode(batch, output, changed, start=num_prefill)
                if not batch.is_decode:
                    self._process_prefill(batch, output, changed, end=num_prefill)
        if not self.running and self.chunked_req is None:
            self.new_token_ratio = self.init_new_token_ratio

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
            timed_out = not future.done()  # before the release, which may cancel a compile nobody else waits for
            self.validator.release_grammar(req)
            try:
                if timed_out:
                    raise ValueError(f"the grammar did not compile within --grammar-compile-timeout {budget:g} s; "
                                     "simplify it (fewer alternatives, less nesting)")
                req.grammar = future.result()
            except ValueError as e:  # the request's own grammar is at fault: a 400, not a server error
                self._finish(req, FinishReason(FinishKind.ABORT, message=str(e), error_code="bad_request"))
                changed.append(req)
                continue
            except Exception as e:  # the compile machinery failed (a worker process could not start): this request only
                self._finish(req, FinishReason(FinishKind.ABORT, message=f"grammar compile failed: {e}", error_code="internal"))
                changed.append(req)
                continue
            self._queue_or_load(req)
        self.grammar_pending = still_pending

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
            if req.grammar.admits_nothing():  # a dead end of the request's own grammar: its fault (400)
                return FinishReason(FinishKind.ABORT, error_code="bad_request", message=(
                    f"{req.grammar.key[0]} cannot be satisfied: after {len(req.output_ids) - 1} output tokens it "
                    "allows no next token, not even the end of the output (e.g. a $ref that refers only to itself)"))
            # Else the sampler did not apply the grammar mask: a bug; SGLang aborts too.
            return FinishReason(FinishKind.ABORT, message=f"the grammar rejected sampled token {token}")
        return self.stop_checker.check(req)

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

    def _queue_or_load(self, req: Req) -> None:
        """Queue a new request, unless the disk tier holds more of its prefix: then it queues once that is loaded."""
        if self.tier_loads is None or not self.tier_loads.hold_if_on_disk(req):
            self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        self._waiting[req] = None
        self.policy.on_enqueue(req)
        if self.prefill_turns is not None and self.chunked_req is not None:
            self.prefill_turns.queued_since_shared = True

    def _dequeue(self, req: Req) -> None:
        del self._waiting[req]
        self.policy.on_dequeue(req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        if self.proposer is not None:
            self.proposer.remember(req)
        self.kv.release(req)
        self._live.pop(req.rid, None)
        self.metrics.on_finish(req)

    # ------------------------------------------------------------------ maintenance

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        self.kv.flush()
        if self.proposer is not None and self.proposer.pool is not None:
            self.proposer.pool.clear()  # like the prefix cache: nothing of earlier requests is reused
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
        return scheduler_stats(self)
