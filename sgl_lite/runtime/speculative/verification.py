"""Verification of speculative drafts: which draft tokens the target model accepts, and the next token.

A request with draft d_0..d_{k-1} is run over k + 1 new positions (its last token, then the draft), so
the forward yields the model's distribution p_j at every position j = 0..k. Position j's distribution
is the one the request would sample from had d_0..d_{j-1} been its own outputs.

- Greedy: accept d_j while d_j == argmax p_j; the first mismatch position (or k) adds argmax p_j. The
  tokens are exactly those of plain greedy decoding.
- Sampled: n-gram drafts are deterministic (a point mass q_j = one-hot(d_j)), so speculative sampling's
  rule accepts d_j with probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j); on rejection it draws from
  the residual max(p_j - q_j, 0) renormalized, i.e. p_j with d_j removed. Every emitted token is then
  distributed exactly as plain sampling from p_j (Leviathan et al. 2023, Chen et al. 2023), and a
  fully accepted draft adds a token drawn from p_k.

Either way a verified draft yields between 1 and k + 1 tokens.

A request with a grammar drafts only tokens its grammar allows (the scheduler cuts the draft at the first
one it forbids), and position j's logits are masked with the grammar's state after d_0..d_{j-1} before
either rule: the distribution is then exactly what plain constrained decoding samples from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.sampling.sampler import Sampler, _inverse_cdf, argmax_ids


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
    if all(r.sampling_params.is_greedy for r in reqs):
        return _verify_greedy(argmax_ids(logits.float()).tolist(), drafts)
    row_reqs = [req for req, n in zip(reqs, sizes) for _ in range(n)]
    probs = sampler.target_probs(logits, row_reqs)
    out: list[list[int]] = []
    offset = 0
    for req, draft in zip(reqs, drafts):
        out.append(_verify_one(sampler, req, draft, probs[offset : offset + len(draft) + 1]))
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


def _verify_one(sampler: Sampler, req: Req, draft: Sequence[int], probs: torch.Tensor) -> list[int]:
    """`probs` [len(draft) + 1, V]: the target distribution at each position."""
    device = probs.device
    if req.sampling_params.is_greedy:
        return _verify_greedy(probs.argmax(dim=-1).tolist(), [draft])[0]
    tokens: list[int] = []
    for j, token in enumerate(draft):
        if sampler.uniform(req, device) < float(probs[j, token]):
            tokens.append(int(token))
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # p_j was a point mass on the draft token: it cannot be rejected
            tokens.append(int(token))
            continue
        tokens.append(_draw(sampler, req, residual))
        return tokens
    tokens.append(_draw(sampler, req, probs[len(draft)]))
    return tokens


def _draw(sampler: Sampler, req: Req, weights: torch.Tensor) -> int:
    uniform = torch.tensor([sampler.uniform(req, weights.device)], device=weights.device)
    return int(_inverse_cdf(weights.unsqueeze(0), uniform))
