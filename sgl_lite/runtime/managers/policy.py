"""Waiting-queue order: fcfs, lpm, dfs-weight, lof, random, each optionally under priority scheduling.

`SchedulePolicy.order(waiting)` sorts the list in place and returns the radix matches it computed
(cache-aware policies only), so admission can reuse them within the same step: nothing is evicted
between ordering and admission, and a later match that splits an edge keeps earlier `last_node`s
valid (a split keeps the lower half on the original node).

Semantics follow SGLang 0.5.7's `SchedulePolicy.calc_priority`:
- fcfs: arrival order; lof: largest max_new_tokens first; random: shuffled (seeded by --random-seed).
- lpm: longest cached prefix first. In-batch prefix de-duplication: a request whose cached prefix
  is at most `in_batch_prefix_caching_check_threshold` tokens is matched against the prompts of the
  requests before it in this round; when it shares at least
  `in_batch_prefix_caching_deprioritize_threshold` tokens with one of them, it goes to the end, so
  the shared part gets computed (and cached) once before it is admitted.
- dfs-weight: walk the radix tree from the root, heaviest child first, where a node's weight is the
  number of waiting requests whose match ends in its subtree; emit each node's requests after its
  children's.
- lpm and dfs-weight fall back to fcfs above `--lpm-fallback-threshold` waiting requests when it is
  set (SGLang hard-codes 128 because its ordering re-matches the whole queue) and whenever the radix
  cache is disabled.
- With --enable-priority-scheduling, the policy's order is refined by a stable sort on priority,
  so priority comes first and the policy (fcfs: arrival) breaks ties.

sgl_lite additions (docs/scheduling.md, "Scheduling beyond SGLang"):
- `--priority-aging-rate r`: the priority sort uses priority + r * (seconds since arrival), in the
  urgent direction, so a request at most D priority units worse than a stream of fresh arrivals is
  ordered before them once it has waited D / r seconds (0: SGLang's static priority).
- `--lpm-max-wait W`: under lpm / dfs-weight, requests that have waited more than W seconds come
  first, oldest first, so a cache-cold request cannot starve behind cache-hot ones.
- Incremental ordering: without priority scheduling, fcfs, lpm and dfs-weight are read lazily from a
  `WaitingIndex` that follows the tree (waiting_index.py): a step costs O(admitted), not O(queue).
  `order()` below is the straightforward computation it must equal, and the path used with
  --disable-incremental-ordering or priority scheduling.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Sequence

import torch

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.managers.waiting_index import WaitingIndex
from sgl_lite.runtime.mem_cache.radix_cache import MatchResult, RadixCache, TreeNode
from sgl_lite.runtime.server_args import ServerArgs

CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")
INDEXED_POLICIES = ("fcfs", *CACHE_AWARE_POLICIES)  # orders the WaitingIndex can read lazily


def prefix_match_key(req: Req) -> list[int]:
    """The longest part of req.fill_ids that may come from the cache.

    At least one token is always computed (it yields the logits for the next token), and for
    input logprobs from `logprob_start_len` on, the logits at position logprob_start_len - 1 must
    be computed too.
    """
    fill = req.fill_ids
    max_len = len(fill) - 1
    if req.return_logprob and req.logprob_start_len >= 0:
        max_len = min(max_len, req.logprob_start_len - 1)
    return fill[: max(max_len, 0)]


def priority_sort_key(req: Req, low_values_first: bool) -> int:
    """Smaller key = more urgent."""
    priority = req.priority or 0
    return priority if low_values_first else -priority


class SchedulePolicy:
    def __init__(self, args: ServerArgs, tree_cache: RadixCache, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = args.schedule_policy
        if self.policy in CACHE_AWARE_POLICIES and tree_cache.disable:
            self.policy = "fcfs"  # nothing to match against: same as SGLang
        self.tree_cache = tree_cache
        self.fallback_threshold = args.lpm_fallback_threshold
        self.check_threshold = args.in_batch_prefix_caching_check_threshold
        self.deprioritize_threshold = args.in_batch_prefix_caching_deprioritize_threshold
        self.enable_priority = args.enable_priority_scheduling
        self.low_values_first = args.schedule_low_priority_values_first
        self.rng = random.Random(args.random_seed)
        self.clock = clock  # the clock of Req.arrival_time (waits are measured from arrival)
        self.aging_rate = args.priority_aging_rate
        self.max_wait = args.lpm_max_wait
        # Prompts seen earlier in this round (in-batch de-duplication); slots are dummies.
        self._in_batch_tree = RadixCache(None, None)
        self.index: WaitingIndex | None = None
        if self.policy in INDEXED_POLICIES and not self.enable_priority and not args.disable_incremental_ordering:
            self.index = WaitingIndex(tree_cache, self.policy, prefix_match_key, self.check_threshold,
                                      self.deprioritize_threshold)

    def active_policy(self, num_waiting: int) -> str:
        threshold = self.fallback_threshold
        if self.policy in CACHE_AWARE_POLICIES and threshold is not None and num_waiting > threshold:
            return "fcfs"
        return self.policy

    def urgency(self, req: Req, now: float) -> float:
        """Smaller = more urgent: the priority (direction-aware) improved by aging since arrival."""
        key = priority_sort_key(req, self.low_values_first)
        return key - self.aging_rate * (now - req.arrival_time) if self.aging_rate else key

    # ------------------------------------------------------------------ the scheduler's interface

    def on_enqueue(self, req: Req) -> None:
        if self.index is not None:
            self.index.add(req)

    def on_dequeue(self, req: Req) -> None:
        if self.index is not None:
            self.index.remove(req)

    def candidates(self, waiting: Iterable[Req], limit: int) -> tuple[list[Req], dict[Req, MatchResult]]:
        """The waiting requests in policy order (at least the first `limit`), and any matches computed.

        With the incremental index only the first `limit` are produced, and no match (the tree must not
        change while the index is read; admission matches the few it admits).
        """
        if self.index is None:
            queue = list(waiting)
            return queue, (self.order(queue) if queue else {})
        if self.active_policy(len(self.index)) == "fcfs":
            return list(itertools.islice(self.index.fcfs(), limit)), {}
        return list(itertools.islice(self.index.ordered(self.clock(), self.max_wait), limit)), {}

    # ------------------------------------------------------------------ the straightforward order

    def order(self, waiting: list[Req]) -> dict[Req, MatchResult]:
        """Sort `waiting` in place; return the prefix matches computed on the way (may be empty).

        O(queue) radix matches for lpm / dfs-weight: the reference the incremental index must equal.
        """
        now = self.clock()
        policy = self.active_policy(len(waiting))
        matches: dict[Req, MatchResult] = {}
        if policy == "fcfs":
            waiting.sort(key=lambda r: r.arrival_time)
        elif policy == "lof":
            waiting.sort(key=lambda r: (-r.sampling_params.max_new_tokens, r.arrival_time))
        elif policy == "random":
            self.rng.shuffle(waiting)
        elif policy == "lpm":
            waiting.sort(key=lambda r: r.arrival_time)  # ties (and in-batch checks) in arrival order
            deprioritized = self._match_all(waiting, matches, in_batch_check=True)
            waiting.sort(key=lambda r: (r in deprioritized, -matches[r].length))
        elif policy == "dfs-weight":
            waiting.sort(key=lambda r: r.arrival_time)
            self._match_all(waiting, matches, in_batch_check=False)
            waiting[:] = dfs_weight_order(self.tree_cache.root_node, waiting, {r: matches[r].last_node for r in waiting})
        else:
            raise ValueError(f"unknown schedule policy {policy!r}")
        max_wait = self.max_wait
        if policy in CACHE_AWARE_POLICIES and max_wait is not None:
            waiting.sort(key=lambda r: (0, r.arrival_time) if now - r.arrival_time > max_wait else (1, 0.0))
        if self.enable_priority:
            waiting.sort(key=lambda r: self.urgency(r, now))
        return matches

    def _match_all(self, waiting: Sequence[Req], matches: dict[Req, MatchResult], in_batch_check: bool) -> set[Req]:
        deprioritized: set[Req] = set()
        if in_batch_check:
            self._in_batch_tree.reset()
        for req in waiting:
            key = prefix_match_key(req)
            match = self.tree_cache.match_prefix(key)
            matches[req] = match
            if not in_batch_check or match.length > self.check_threshold:
                continue
            shared = self._in_batch_tree.match_prefix(key).length
            if shared >= self.deprioritize_threshold:
                deprioritized.add(req)
            else:
                self._in_batch_tree.insert(key, torch.zeros(len(key), dtype=torch.int64))
        return deprioritized


def dfs_weight_order(root: TreeNode, waiting: Sequence[Req], last_nodes: dict[Req, TreeNode]) -> list[Req]:
    """SGLang's _sort_by_dfs_weight: requests grouped by match node, heaviest subtrees first.

    Children of equal weight keep the tree's child order (insertion order). Requests at one node
    keep their queue order. Iterative, so deep trees do not hit the recursion limit.
    """
    node_reqs: dict[TreeNode, list[Req]] = defaultdict(list)
    for req in waiting:
        node_reqs[last_nodes[req]].append(req)
    weight: dict[TreeNode, int] = defaultdict(int)
    for node, reqs in node_reqs.items():
        # Propagate each node's count up to the root: weight = waiting requests in the subtree.
        n = len(reqs)
        while node is not None:
            weight[node] += n
            node = node.parent
    out: list[Req] = []
    # Post-order walk restricted to weighted nodes: (node, children_done).
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            out.extend(node_reqs.get(node, ()))
            continue
        stack.append((node, True))
        children = [c for c in node.children.values() if weight.get(c, 0) > 0]
        children.sort(key=lambda c: -weight[c])
        stack.extend((c, False) for c in reversed(children))
    return out
