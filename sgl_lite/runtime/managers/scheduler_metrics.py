"""What the scheduler tells the outside about its batches: SGLang's log lines and counters.

- a "Prefill batch" line per prefill batch and a "Decode batch" line every --decode-log-interval
  decode steps, worded as SGLang's scheduler logs them so that its users read them at a glance;
- the generation throughput measured over those decode intervals (SGLang's gen_throughput gauge);
- counters of generated tokens and of finished / aborted requests (exported as sglang:* metrics);
- with --log-requests, one line per finished request with its (bounded) input and output text.

The hot path pays one counter update per step; the log lines are built only when they are due and
the log level lets them through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sgl_lite.runtime.managers.request import FinishKind, Req

if TYPE_CHECKING:
    from sgl_lite.runtime.managers.scheduler import Scheduler
    from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger("sgl_lite.runtime.scheduler")

# --log-requests: each text is cut to this many tokens, so a long prompt makes a bounded line.
LOGGED_TOKENS = 512


class SchedulerMetrics:
    def __init__(self, decode_log_interval: int, log_requests: bool, tokenizer: Any = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.decode_log_interval = decode_log_interval
        self.log_requests = log_requests
        self.tokenizer = tokenizer
        self.clock = clock
        self.generated_tokens_total = 0
        self.jump_forward_tokens_total = 0  # output tokens written by jump-forward (part of the generated ones)
        self.finished_requests_total = 0
        self.aborted_requests_total = 0
        self.gen_throughput = 0.0  # token/s over the last completed decode-log interval
        self._decode_steps = 0
        self._interval_start = clock()
        self._interval_tokens = 0

    def on_batch(self, scheduler: Scheduler, batch: ForwardBatch, num_prefill: int) -> None:
        """Called once per forward, before it runs (so queue and running counts are the scheduler's view)."""
        tokens = sum(batch.sample)
        self.generated_tokens_total += tokens
        self._interval_tokens += tokens
        if num_prefill:  # a speculative verification step, or one extending jumped requests, is a decode step
            if logger.isEnabledFor(logging.INFO):
                logger.info(self._prefill_line(scheduler, batch, num_prefill))
            return
        self._decode_steps += 1
        if self._decode_steps % self.decode_log_interval:
            return
        now = self.clock()
        self.gen_throughput = self._interval_tokens / max(now - self._interval_start, 1e-9)
        self._interval_start, self._interval_tokens = now, 0
        if logger.isEnabledFor(logging.INFO):
            used, usage = token_usage(scheduler)
            logger.info(f"Decode batch, #running-req: {len(batch.reqs)}, #token: {used}, token usage: {usage:.2f}, "
                        f"gen throughput (token/s): {self.gen_throughput:.2f}, #queue-req: {scheduler.num_waiting()}, ")

    @staticmethod
    def _prefill_line(scheduler: Scheduler, batch: ForwardBatch, num_prefill: int) -> str:
        new_tokens = sum(batch.extend_lens[:num_prefill])
        # A continuing chunk's prefix is its own earlier chunks, not a cache hit (before the forward,
        # scheduler.chunked_req is the request whose next chunk this batch computes).
        continuing = scheduler.chunked_req
        cached = sum(p for p, r in zip(batch.prefix_lens[:num_prefill], batch.reqs) if r is not continuing)
        _, usage = token_usage(scheduler)
        return (f"Prefill batch, #new-seq: {num_prefill}, #new-token: {new_tokens}, #cached-token: {cached}, "
                f"token usage: {usage:.2f}, #running-req: {len(scheduler.running)}, "
                f"#queue-req: {scheduler.num_waiting()}, ")

    def on_accepted_drafts(self, num_tokens: int) -> None:
        """Draft tokens a verification step added beyond its one token per row (counted by on_batch)."""
        self.generated_tokens_total += num_tokens
        self._interval_tokens += num_tokens

    def on_jump_forward(self, num_tokens: int) -> None:
        """Output tokens a jump-forward wrote (net of the sampled ones its retokenization replaced)."""
        self.jump_forward_tokens_total += num_tokens
        self.generated_tokens_total += num_tokens
        self._interval_tokens += num_tokens

    def on_finish(self, req: Req) -> None:
        self.finished_requests_total += 1
        reason = req.finished_reason
        if reason is not None and reason.kind == FinishKind.ABORT:
            self.aborted_requests_total += 1
        if self.log_requests:
            logger.info("Finish: rid=%s, finish_reason=%s, prompt_tokens=%d, completion_tokens=%d, "
                        "cached_tokens=%d, in=%r, out=%r", req.rid, reason.to_json() if reason else None,
                        len(req.input_ids), len(req.output_ids), req.cached_tokens,
                        self._text(req.input_ids), self._text(req.output_ids))

    def _text(self, ids: list[int]) -> str:
        shown = ids[:LOGGED_TOKENS]
        text = self.tokenizer.decode(shown) if self.tokenizer is not None else str(shown)
        return text + (f"... (+{len(ids) - len(shown)} tokens)" if len(ids) > len(shown) else "")


def token_usage(scheduler: Scheduler) -> tuple[int, float]:
    """KV slots held by requests (SGLang's num_used_tokens: neither free nor merely cached) and their share."""
    total = scheduler.num_slots
    used = total - scheduler.kv.allocator.available_size - scheduler.kv.tree_cache.evictable_size()
    return used, used / total if total else 0.0


def scheduler_stats(scheduler: Scheduler) -> dict[str, Any]:
    """The scheduler's counters and gauges: server_info's stats, exported as /metrics."""
    prompt = scheduler.prompt_tokens_total
    used, usage = token_usage(scheduler)
    return {
        "num_waiting": scheduler.num_waiting(),
        "num_running": len(scheduler.running),
        "num_chunked": int(scheduler.chunked_req is not None),
        "num_grammar_pending": len(scheduler.grammar_pending),
        "num_tier_loading": len(scheduler.tier_loads) if scheduler.tier_loads is not None else 0,
        "slots_total": scheduler.num_slots,
        "slots_free": scheduler.kv.allocator.available_size,
        "slots_evictable": scheduler.kv.tree_cache.evictable_size(),
        "slots_protected": scheduler.kv.tree_cache.protected_size(),
        "slots_loading": scheduler.kv.loading_tokens,
        "num_session_pins": len(scheduler.kv.tree_cache.pins),  # open sessions' prefixes kept last (session_pins.py)
        "cached_tokens_total": scheduler.cached_tokens_total,
        "prompt_tokens_total": prompt,
        "cache_hit_rate": scheduler.cached_tokens_total / prompt if prompt else 0.0,
        "num_retractions": scheduler.num_retractions,
        "num_preemptions": scheduler.num_preemptions,
        "num_forward_steps": scheduler.num_forward_steps,
        "num_used_tokens": used,
        "token_usage": usage,
        "gen_throughput": scheduler.metrics.gen_throughput,
        "generated_tokens_total": scheduler.metrics.generated_tokens_total,
        "jump_forward_tokens_total": scheduler.metrics.jump_forward_tokens_total,
        "num_finished_requests": scheduler.metrics.finished_requests_total,
        "num_aborted_requests": scheduler.metrics.aborted_requests_total,
        "new_token_ratio": scheduler.new_token_ratio,
        "schedule_policy": scheduler.policy.policy,
        "max_running_requests": scheduler.max_running_requests,
        "chunked_prefill_size": scheduler.chunk_size,
        **(scheduler.proposer.stats() if scheduler.proposer is not None else {}),
        **(scheduler.kv.tier.stats() if scheduler.kv.tier is not None else {}),
    }
