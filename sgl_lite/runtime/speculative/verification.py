"""Verification of speculative drafts: which draft tokens the target model accepts, and the next token.

A request with draft d_0..d_{k-1} is run over k + 1 new positions (its last token, then the draft), so
the forward yields the model's distribution p_j at every position j = 0..k. Position j's distribution
is the one the request would sample from had d_0..d_{j-1} been its own outputs.

- Greedy: accept d_j while d_j == argmax p_j; the first mismatch position (or k) adds argmax p_j. The
  tokens are exactly those of plain greedy decoding.
- Sampled: position j takes the request's (j+1)-th next uniform from its own generator and picks the
  token plain sampling would pick with it from p_j (`Sampler.sampled_ids`, the same rule); d_j is
  accepted while it equals that pick, and the first pick that differs (or the pick at position k) is
  the added token. The generator then advances by one uniform per emitted token, as plain decoding's
  would. An n-gram draft is a point mass, so d_j is accepted with probability p_j(d_j), exactly
  speculative sampling's rate (Leviathan et al. 2023), and on rejection the added token is the pick,
  distributed as p_j given that it is not d_j: speculative sampling's residual. More than equal in
  distribution, the tokens are those plain decoding draws with the same uniforms, so a seeded request
  outputs the same tokens with speculation on and off (where the logits are the same bits).

Either way a verified draft yields between 1 and k + 1 tokens.

A request's logit_bias is added to every position's logits, as plain decoding adds it to each step's.

A request with a grammar drafts only tokens its grammar allows (the scheduler cuts the draft at the first
one it forbids), and position j's logits are masked with the grammar's state after d_0..d_{j-1} before
either rule: the distribution is then exactly what plain constrained decoding samples from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.sampling.sampler import Sampler, add_logit_bias, argmax_ids


def verify_drafts(sampler: Sampler, logits: torch.Tensor, reqs: Sequence[Req],
                  drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per request, the tokens to append (accepted draft prefix + one more).

    `logits` holds len(drafts[i]) + 1 consecutive rows for request i, in request order.
    """
    sizes = [len(d) + 1 for d in drafts]
    if logits.shape[0] != sum(sizes):
        raise ValueError(f"verification got {logits.shape[0]} logit rows for drafts needing {sum(sizes)}")
    if any(r.grammar is not None for r in reqs):
        logits = _grammar_masked(logits, reqs, drafts)
    if any(r.sampling_params.logit_bias for r in reqs):  # static per request: the same at every position
        logits = logits.float().clone()
        add_logit_bias(logits, [r.sampling_params for r, d in zip(reqs, drafts) for _ in range(len(d) + 1)])
    if all(r.sampling_params.is_greedy for r in reqs):
        return _verify_greedy(argmax_ids(logits.float()).tolist(), drafts)
    out: list[list[int]] = []
    offset = 0
    for req, draft in zip(reqs, drafts):
        out.append(_verify_one(sampler, req, draft, logits[offset : offset + len(draft) + 1].float()))
        offset += len(draft) + 1
    return out


def _grammar_masked(logits: torch.Tensor, reqs: Sequence[Req], drafts: Sequence[Sequence[int]]) -> torch.Tensor:
    """A float copy of `logits` where each constrained request's rows carry its grammar's mask at that position."""
    from sgl_lite.runtime.sampling.grammar import apply_draft_grammar_masks  # lazy: xgrammar only when used

    out = logits.float().clone()
    offset = 0
    for req, draft in zip(reqs, drafts):
        if req.grammar is not None:
            apply_draft_grammar_masks(out[offset : offset + len(draft) + 1], req.grammar, draft)
        offset += len(draft) + 1
    return out


def _verify_greedy(targets: list[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    out, offset = [], 0
    for draft in drafts:
        tokens = []
        for j in range(len(draft) + 1):
            tokens.append(targets[offset + j])
            if j == len(draft) or draft[j] != targets[offset + j]:
                break
        out.append(tokens)
        offset += len(draft) + 1
    return out


def _verify_one(sampler: Sampler, req: Req, draft: Sequence[int], logits: torch.Tensor) -> list[int]:
    """`logits` [len(draft) + 1, V]: the (grammar-masked) logits at each position."""
    if req.sampling_params.is_greedy:
        return _verify_greedy(argmax_ids(logits).tolist(), [draft])[0]
    positions = len(draft) + 1
    uniforms = sampler.peek_uniforms(req, positions, logits.device)
    picks = sampler.sampled_ids(logits, [req.sampling_params] * positions, uniforms).tolist()
    tokens = _verify_greedy(picks, [draft])[0]
    sampler.skip_uniforms(req, len(tokens), logits.device)
    return tokens
