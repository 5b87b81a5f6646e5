"""Constrained decoding with xgrammar: compile a request's regex / JSON schema / EBNF into a token
matcher, and mask the logits of constrained rows to the tokens the grammar allows next.

Life of a constrained request (what the scheduler and sampler do with this module):
- admission: `backend.validate(params)` (cheap parse, ValueError naming the field), then
  `backend.request_matcher(params)` returns a Future; the request waits in the queue until it is done.
  A Future that raises ValueError means the grammar could not be compiled: the request is aborted
  with that message.
- each sampling step: `apply_grammar_masks(logits, [r.grammar for r in reqs])` before sampling;
  after sampling, `req.grammar.accept_token(tok)` (False only if the mask was not applied: abort);
  when `req.grammar.is_terminated()` the request finishes (FinishKind.STOP, matched=tok), even
  before min_new_tokens.
- speculative decoding (runtime/speculative/verification.py): a draft is cut at the first token the grammar
  forbids (`allowed_prefix`), and verified with `apply_draft_grammar_masks`: each verified position is
  masked with the state after the draft tokens before it; the matcher advances only by the tokens kept.
- retraction keeps output_ids and so the matcher's state; a request whose output is dropped and
  recomputed needs `req.grammar.reset()` (or `rollback(n)` for n dropped tokens).

EOS follows SGLang: the model's EOS ids are the grammar's stop tokens. The mask allows them exactly
when the output so far is a complete match, and accepting one terminates the matcher. A complete
match that admits no longer continuation (e.g. `[0-9]{3}` after three digits) allows only EOS.

The compile side (GrammarBackend, GrammarMatcher) lives in grammar_backend.py; this module is the
per-step side and the import point for the rest of the runtime.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import xgrammar

from sgl_lite.runtime.sampling.grammar_backend import GrammarBackend, GrammarKey, GrammarMatcher, grammar_key

__all__ = ["GrammarBackend", "GrammarKey", "GrammarMatcher", "apply_draft_grammar_masks", "apply_grammar_masks", "grammar_key"]


class _BitmaskBuffer(threading.local):
    """A bitmask grown to the largest batch seen; batches use its first rows (no per-step allocation).

    Thread-local, so two schedulers in one process never fill the same buffer.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def get(self, batch_size: int, vocab_size: int) -> torch.Tensor:
        words = (vocab_size + 31) // 32
        if self.buffer is None or self.buffer.shape[0] < batch_size or self.buffer.shape[1] != words:
            self.buffer = xgrammar.allocate_token_bitmask(batch_size, vocab_size)
        return self.buffer[:batch_size]


_bitmask_buffer = _BitmaskBuffer()


def apply_grammar_masks(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
    """Set to -inf, in place, the logits each row's grammar forbids next; None rows are untouched.

    logits: [B, V] (any float dtype, CPU or CUDA), one row per entry of `matchers`. Columns at or
    beyond a matcher's vocab_size (padding of the logits width) are forbidden for constrained rows.
    """
    if logits.dim() != 2 or logits.shape[0] != len(matchers):
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(matchers)} matchers")
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocab_size = 0
    for i in rows:
        matcher = matchers[i]
        if not isinstance(matcher, GrammarMatcher):
            raise TypeError(f"row {i}: expected a GrammarMatcher or None, got {type(matcher).__name__}")
        vocab_size = max(vocab_size, matcher.vocab_size)
    bitmask = _bitmask_buffer.get(len(matchers), vocab_size)
    masked_rows = [i for i in rows if matchers[i].fill_bitmask(bitmask, i)]  # type: ignore[union-attr]
    if masked_rows:
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        width = min(vocab_size, logits.shape[1])
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=masked_rows)
    if logits.shape[1] > vocab_size:
        logits[rows, vocab_size:] = float("-inf")


def apply_draft_grammar_masks(logits: torch.Tensor, matcher: GrammarMatcher, draft: Sequence[int]) -> None:
    """Speculative verification of a constrained request: row j of `logits` ([len(draft) + 1, V], in
    place) gets the mask of the grammar state after the draft's first j tokens, as plain decoding
    would have applied at that position. The draft must be one the grammar accepts (allowed_prefix)."""
    if logits.dim() != 2 or logits.shape[0] != len(draft) + 1:
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match a draft of {len(draft)} tokens")
    bitmask = xgrammar.allocate_token_bitmask(len(draft) + 1, matcher.vocab_size)
    matcher.fill_draft_bitmasks(draft, bitmask)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(matcher.vocab_size, logits.shape[1]))
    if logits.shape[1] > matcher.vocab_size:
        logits[:, matcher.vocab_size:] = float("-inf")
