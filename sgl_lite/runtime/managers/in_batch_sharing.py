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

from sgl_lite.runtime.mem_cache.radix_cache import RadixCache

# Borrowing fewer tokens saves less compute than the tree insert and lock move it costs afterwards
# (chat prompts share their first few template tokens by construction).
MIN_SHARED_TOKENS = 16


@dataclass
class Borrow:
    """Positions [prefix_len, prefix_len + length) of the borrower read the slots that `lenders[k]`
    (plan indices, all smaller than the borrower's) hold at the same positions."""

    lenders: torch.Tensor  # int64 [length]

    @property
    def length(self) -> int:
        return int(self.lenders.numel())


class BatchPrefixIndex:
    """The token ranges the plans admitted so far in this round will hold after the forward.

    A pool-free radix tree whose "slots" are plan indices: insert keeps existing values, so each
    position names the earliest plan that holds it (its lender).
    """

    def __init__(self, min_tokens: int = MIN_SHARED_TOKENS) -> None:
        self.min_tokens = min_tokens
        self._tree = RadixCache(None, None)

    def borrow(self, fill_ids: Sequence[int], prefix_len: int, shareable_len: int) -> Borrow | None:
        """What a request whose KV covers [0, prefix_len) can read for positions [prefix_len, s), with
        s <= shareable_len (prefix_match_key: the last token and logprob-scored positions are always
        computed); None below `min_tokens`."""
        if shareable_len - prefix_len < self.min_tokens:
            return None
        match = self._tree.match_prefix(fill_ids[:shareable_len])
        if match.length - prefix_len < self.min_tokens:
            return None
        return Borrow(lenders=match.slots[prefix_len : match.length].clone())

    def add(self, fill_ids: Sequence[int], held_len: int, plan_index: int) -> None:
        """Plan `plan_index` will hold the KV of fill_ids[:held_len] after the forward."""
        self._tree.insert(fill_ids[:held_len], torch.full((held_len,), plan_index, dtype=torch.int64))
