"""The decode half of the Scheduler's step: one token (or a verified draft) per running request.

`DecodeScheduling` is a mixin of `Scheduler` (scheduler.py), which owns every attribute it reads and
writes. `_decode_batch` makes room for one more token per running request (retracting the requests
with the fewest outputs when free + evictable slots cannot hold them, SGLang's retract_decode) and,
with `--speculative-algorithm ngram`, attaches n-gram drafts (ngram_proposer.py) that fit in free slots,
sized together as what pays in the step (`NgramProposer.propose_step`).
`_process_decode` appends each row's token, or a verified draft's accepted tokens up to a stop, freeing
the slots of the draft positions it rejected.

Jump-forward (sampling/jump_forward.py): before the batch is built, each constrained request whose
grammar forces text appends it (`_jump_forward`), its retokenized tail replacing the last output
tokens that differ; the KV of replaced tokens is freed at once, and the request's row in this step's
forward extends by every token without KV (its last sampled one, the jumped ones), sampling after the
last. Stop checks run after each jumped token, so a jump that reaches max_new_tokens, the context or
a stop string ends the request exactly there, before the forward. A request jumps only when the free
slots (after eviction) hold its extra tokens, and it does not draft in the step it jumps.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sgl_lite.runtime.managers.preemption import new_token_ratio_after_retraction, retraction_order
from sgl_lite.runtime.managers.request import FinishKind, FinishReason, Req
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch, ForwardOutput
from sgl_lite.runtime.sampling.jump_forward import RETOKENIZE_TAIL_TOKENS, Jump, move_matcher

if TYPE_CHECKING:
    from sgl_lite.runtime.managers.scheduler import Scheduler

    _Base = Scheduler
else:
    _Base = object

logger = logging.getLogger("sgl_lite.runtime.managers.scheduler")

NEW_TOKEN_RATIO_DECAY = 0.001


class DecodeScheduling(_Base):
    def _decode_batch(self, changed: list[Req]) -> ForwardBatch | None:
        if not self.running:
            return None
        if not self.kv.ensure_free(len(self.running)):
            self._retract(changed)
            if not self.running:
                return None
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, self.min_new_token_ratio)
        if self.jump_forward is not None:
            self._jump_forward(changed)
            if not self.running:
                return None
        drafts = self._drafts() if self.proposer is not None else None
        # Tokens without KV: 1 per request, more for one that jumped this step.
        own = [r.seq_len - r.kv_len for r in self.running]
        if drafts is None or not any(drafts):
            return self.kv.build_batch(list(zip(self.running, own)), is_decode=all(n == 1 for n in own))
        return self.kv.build_batch([(r, n + len(d)) for r, n, d in zip(self.running, own, drafts)], is_decode=False, drafts=drafts)

    def _jump_forward(self, changed: list[Req]) -> None:
        """Append what each constrained running request's grammar forces (module docstring)."""
        assert self.jump_forward is not None
        needed = len(self.running)  # slots this step needs so far (ensure_free found them)
        for req in list(self.running):
            if req.grammar is None or len(req.output_ids) < req.sampling_params.min_new_tokens:
                continue  # under min_new_tokens, a stop string seen again on retokenized text must not end it
            # Tokens in the radix tree (a retracted request's, re-prefilled) or sent to a stream stay.
            floor = max(req.jump_settled, req.prefix_len - len(req.input_ids))
            jump = self.jump_forward.find(req.grammar, req.input_ids, req.output_ids, floor)
            if jump is None:
                continue
            grown = jump.keep + len(jump.tokens) - len(req.output_ids)
            if not self.kv.ensure_free(needed + max(grown, 0)):
                continue
            if not move_matcher(req.grammar, req.output_ids[jump.keep:], jump.tokens):
                continue
            reason = self._apply_jump(req, jump)
            if reason is None:
                needed += grown
                continue
            self._finish(req, reason)
            changed.append(req)
            self.running.remove(req)
            self.batch_is_full = False
            needed -= 1

    def _apply_jump(self, req: Req, jump: Jump) -> FinishReason | None:
        """Replace the request's output from `jump.keep` on with the jump's tokens (the matcher has
        accepted them), one at a time through the stop checks; the reason it must finish, if any."""
        before = len(req.output_ids)
        start = len(req.input_ids) + jump.keep
        if start < req.kv_len:  # the replaced tokens' KV: private slots (floor), recomputed in the extend
            row = self.req_to_token.table[req.req_pool_idx]
            self.kv.allocator.free(row[start : req.kv_len].clone())
            req.kv_len = start
        del req.output_ids[jump.keep:]
        if req.return_logprob:
            del req.output_token_logprobs[jump.keep:]
            del req.output_top_logprobs[jump.keep:]
        if req.spec_state is not None:
            req.spec_state.truncate(start)
        reason = None
        for i, token in enumerate(jump.tokens):
            req.output_ids.append(token)
            if req.return_logprob:
                req.output_token_logprobs.append(None)
                req.output_top_logprobs.append([])
            reason = self.stop_checker.check(req)
            if reason is not None:
                req.grammar.rollback(len(jump.tokens) - i - 1)
                break
        added = len(req.output_ids) - before
        req.jump_forward_tokens += added
        req.jump_settled = max(req.jump_settled, max(before, len(req.output_ids)) - RETOKENIZE_TAIL_TOKENS)
        self.metrics.on_jump_forward(added)
        return reason

    def _drafts(self) -> list[list[int]] | None:
        """N-gram drafts for the running requests ([] where a request does not draft), or None when
        the free slots cannot hold them: drafts never evict cached prefixes."""
        assert self.proposer is not None
        drafting: list[tuple[Req, int]] = []
        for req in self.running:
            params = req.sampling_params
            # Requests whose next-token distribution depends on the tokens before it in ways the
            # verifier does not replay (penalties, min_new_tokens) decode one token a step; a grammar's
            # state it does replay (speculative/verification.py).
            plain = (len(req.output_ids) >= params.min_new_tokens and req.kv_len == req.seq_len - 1  # not jumped
                     and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
                     and params.repetition_penalty == 1.0)
            # Room for every accepted token plus the one after: within max_new_tokens and the context.
            limit = min(params.max_new_tokens - len(req.output_ids), self.context_length - req.seq_len) - 1
            drafting.append((req, limit if plain else 0))
        drafts = self.proposer.propose_step(drafting)
        own = sum(r.seq_len - r.kv_len for r in self.running)
        if own + sum(map(len, drafts)) > self.kv.allocator.available_size:
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
                req.kv_len += batch.extend_lens[i]  # 1, or more for a request that jumped
                self._append_token(req, output.next_token_ids[i])
            else:
                self._append_verified(req, accepted, batch.extend_lens[i])
            changed.append(req)
        if any(r.finished for r in self.running):
            self.running = [r for r in self.running if not r.finished]
            self.batch_is_full = False

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
        self.metrics.on_accepted_drafts(kept - 1)
        if kept < extend:
            row = self.req_to_token.table[req.req_pool_idx]
            self.kv.allocator.free(row[start + kept : start + extend].clone())
        if kept < len(tokens) and req.return_logprob:  # the runner scored every verified token
            del req.output_token_logprobs[kept - len(tokens):]
            del req.output_top_logprobs[kept - len(tokens):]
        if reason is not None:
            self._finish(req, reason)
