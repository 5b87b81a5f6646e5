"""In-batch prefix sharing: a request reads, instead of computing, the KV of prompt tokens that an
earlier request of the same prefill batch computes in that batch.

Requests that arrive together with a common prefix the tree does not hold yet (agent sessions
starting on one system prompt) would otherwise each compute it. SGLang defers all but one of them
by a round (the in-batch de-duplication in policy.py) when the prefill budget is tight, and
computes the prefix once per request when it is not. Here the first request computes it and the
others attend over its slots in the same forward: no extra round, no extra compute.

Why it is sound: a runner writes every new token's K/V of a layer before any request of the batch
attends in that layer (the ForwardBatch contract), so a later request can list an earlier
request's new slots among its prefix slots. After the forward the scheduler inserts every prefilled
prompt into the radix tree in batch order (`RadixCache.cache_unfinished_req`): a lender goes in
before its borrowers, whose locks then move onto the tree path holding the borrowed slots, so every
slot keeps exactly one owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgl_lite.runtime.radix_cache import RadixCache

# Borrowing fewer tokens saves less compute than the tree insert and lock move it costs afterwards
# (chat prompts share their first few template tokens by construction).
MIN_SHARED_TOKENS = 16


@dataclass
class SharePlan:
    """One request's part of a prefill batch, as in-batch sharing sees it."""

    fill_ids: Sequence[int]
    # Tokens whose KV the request already has (tree prefix or earlier chunks) and tokens it computes now.
    prefix_len: int
    extend_len: int
    # How far its prompt may be reused (prefix_match_key: the last token and logprob-scored
    # positions are always computed); 0 = this request must not borrow.
    shareable_len: int


@dataclass
class Borrow:
    """`positions` [prefix_len, prefix_len + len) of the borrower read the slots that `lenders[k]`
    (batch indices, all smaller than the borrower's) hold at the same positions."""

    lenders: torch.Tensor  # int64 [length]

    @property
    def length(self) -> int:
        return int(self.lenders.numel())


def find_borrows(parts: Sequence[SharePlan], min_tokens: int = MIN_SHARED_TOKENS) -> list[Borrow | None]:
    """For each part (in batch order), the tokens it can borrow from earlier parts, or None.

    Part i may borrow tokens [prefix_len_i, s) when an earlier part j has the same tokens and holds
    their KV by the end of this forward (its prefix or its new tokens): s - prefix_len_i >= min_tokens
    and s <= shareable_len_i. Lenders may themselves be borrowers (chains resolve in batch order).
    """
    borrows: list[Borrow | None] = [None] * len(parts)
    if len(parts) < 2:
        return borrows
    # Pool-free radix tree over this batch's token ranges; a "slot" is the batch index that holds
    # the position first (insert keeps existing values, so the earliest holder stays the lender).
    seen = RadixCache(None, None)
    for i, part in enumerate(parts):
        start, end = part.prefix_len, part.shareable_len
        if end - start >= min_tokens:
            match = seen.match_prefix(part.fill_ids[:end])
            if match.length - start >= min_tokens:
                borrows[i] = Borrow(lenders=match.slots[start : match.length].clone())
        held = part.prefix_len + part.extend_len
        seen.insert(part.fill_ids[:held], torch.full((held,), i, dtype=torch.int64))
    return borrows

