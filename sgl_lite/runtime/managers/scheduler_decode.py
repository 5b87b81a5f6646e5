"""The decode half of the Scheduler's step: one token (or a verified draft) per running request.

`DecodeScheduling` is a mixin of `Scheduler` (scheduler.py), which owns every attribute it reads and
writes. `_decode_batch` makes room for one more token per running request (retracting the requests
with the fewest outputs when free + evictable slots cannot hold them, SGLang's retract_decode) and,
with `--speculative-algorithm ngram`, attaches n-gram drafts (ngram_proposer.py) that fit in free slots,
sized together as what pays in the step (`NgramProposer.propose_step`).
`_process_decode` appends each row's token, or a verified draft's accepted tokens up to a stop, freeing
the slots of the draft positions it rejected.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sgl_lite.runtime.managers.preemption import new_token_ratio_after_retraction, retraction_order
from sgl_lite.runtime.managers.request import FinishKind, FinishReason, Req
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch, ForwardOutput

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
        drafts = self._drafts() if self.proposer is not None else None
        if drafts is None or not any(drafts):
            return self.kv.build_batch([(r, 1) for r in self.running], is_decode=True)
        return self.kv.build_batch([(r, 1 + len(d)) for r, d in zip(self.running, drafts)], is_decode=False, drafts=drafts)

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
            plain = (len(req.output_ids) >= params.min_new_tokens
                     and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
                     and params.repetition_penalty == 1.0)
            # Room for every accepted token plus the one after: within max_new_tokens and the context.
            limit = min(params.max_new_tokens - len(req.output_ids), self.context_length - req.seq_len) - 1
            drafting.append((req, limit if plain else 0))
        drafts = self.proposer.propose_step(drafting)
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
