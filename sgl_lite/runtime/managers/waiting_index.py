"""Incremental cache-aware order of the waiting queue (lpm, dfs-weight) without re-matching every step.

Every waiting request stays attached to the radix node whose edge holds the end of its prefix match:
(node, matched length) with node.parent.depth < matched <= node.depth (the root, length 0, when
nothing matches). The index observes the tree (RadixCache.observer) and keeps attachments current:
- new leaf under P: only requests that fully matched P and continue with the leaf's first token
  can deepen (kept per node by next token), and they move into the leaf;
- split of a node: its requests whose match ends in the upper part move to the new upper node;
- eviction of a leaf: its requests move to the parent, matched length clamped to the parent's depth;
- reset: everything goes back to the root.
Eviction treats a leaf holding waiting requests as used at the last ordering (waiting_touch_time),
as SGLang's per-step re-match of the whole queue does for their prefixes.
So a step costs what changed, not the queue length, and ordering reads the first requests lazily:
- lpm: buckets keyed (deprioritized, -matched), each sorted by (arrival, seq). In-batch prefix
  de-duplication is kept exactly: SGLang's rule (a request with a short match that shares at least
  D tokens with an earlier kept one waits) is equivalent to "among short-match requests with the same
  first D tokens, all but the earliest are deprioritized", maintained per D-token group.
- dfs-weight: subtree counts of attached requests kept along the path on attach/detach; the walk
  visits only nodes with waiting requests. Requests at one node: deeper match first (the order the
  reference gets from splitting the edge at each match), then arrival.
- fcfs: the arrival-sorted list every entry is kept in anyway (no tree tracking at all).
All equal `SchedulePolicy.order`'s straightforward result (tests/test_policy_incremental.py), with
ties of equal arrival_time broken by queue-entry order.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.radix_cache import RadixCache, TreeNode, common_prefix_len


class WaitingEntry:
    __slots__ = ("req", "key", "arrival", "seq", "node", "matched", "deprioritized")

    def __init__(self, req: Req, key: tuple[int, ...], seq: int) -> None:
        self.req = req
        self.key = key
        self.arrival = req.arrival_time
        self.seq = seq  # queue-entry order: breaks arrival ties
        self.node: TreeNode | None = None
        self.matched = 0
        self.deprioritized = False

    def item(self) -> tuple[float, int, WaitingEntry]:
        return (self.arrival, self.seq, self)


SortedItems = list  # of (arrival, seq, entry), ascending; (arrival, seq) is unique so entries are never compared


def _insort(items: SortedItems, entry: WaitingEntry) -> None:
    bisect.insort(items, entry.item())


def _remove(items: SortedItems, entry: WaitingEntry) -> None:
    i = bisect.bisect_left(items, (entry.arrival, entry.seq))
    assert items[i][2] is entry, "waiting index out of sync"
    del items[i]


class WaitingIndex:
    def __init__(self, tree: RadixCache, policy: str, key_fn: Any, check_threshold: int, deprioritize_threshold: int) -> None:
        if policy not in ("fcfs", "lpm", "dfs-weight"):
            raise ValueError(f"the waiting index orders fcfs, lpm or dfs-weight, not {policy!r}")
        self.tree = tree
        self.policy = policy
        self.key_fn = key_fn  # Req -> the part of its tokens that may come from the cache
        self.check_threshold = check_threshold
        self.deprioritize_threshold = deprioritize_threshold
        self._seq = 0
        self.touch_tick = 0  # the tree's tick at the last ordering (see waiting_touch_time)
        self.entries: dict[Req, WaitingEntry] = {}
        self.fifo: SortedItems = []  # every entry by arrival (fcfs fallback, --lpm-max-wait)
        self._clear_structures()
        self.tracks_tree = policy != "fcfs"
        if self.tracks_tree:
            if tree.observer is not None:
                raise ValueError("this radix tree is already observed by another waiting index (one per tree)")
            tree.observer = self

    def _clear_structures(self) -> None:
        self._at: dict[TreeNode, dict[int, SortedItems]] = {}  # node -> matched length -> entries
        self._next: dict[TreeNode, dict[int, dict[WaitingEntry, None]]] = {}  # fully matched node -> next token -> entries
        self._weight: dict[TreeNode, int] = {}  # dfs: attached entries in the subtree
        self._weighted_children: dict[TreeNode, set[TreeNode]] = {}
        self._buckets: dict[tuple[bool, int], SortedItems] = {}  # lpm: (deprioritized, -matched) -> entries
        self._bucket_keys: list[tuple[bool, int]] = []
        self._groups: dict[tuple[int, ...], SortedItems] = {}  # lpm: first-D-token group of short matches

    def __len__(self) -> int:
        return len(self.entries)

    # ------------------------------------------------------------------ queue changes

    def add(self, req: Req) -> None:
        entry = WaitingEntry(req, tuple(self.key_fn(req)), self._seq)
        self._seq += 1
        self.entries[req] = entry
        _insort(self.fifo, entry)
        if not self.tracks_tree:
            return
        node, matched = self._walk(entry.key, self.tree.root_node)
        self._set_place(entry, node, matched)
        self._attach(entry, weights=True)

    def remove(self, req: Req) -> None:
        entry = self.entries.pop(req)
        _remove(self.fifo, entry)
        if not self.tracks_tree:
            return
        self._detach(entry, weights=True)
        if self._is_grouped(entry):
            self._group_leave(entry)

    # ------------------------------------------------------------------ order

    def fcfs(self) -> Iterator[Req]:
        return (item[2].req for item in self.fifo)

    def ordered(self, now: float, max_wait: float | None) -> Iterator[Req]:
        """The queue in policy order, lazily. Read it fully before changing the tree (splits move entries)."""
        if not self.tracks_tree:
            yield from self.fcfs()
            return
        self.touch_tick = self.tree.next_tick()
        if max_wait is not None:
            for arrival, _, entry in self.fifo:
                if not now - arrival > max_wait:  # the reference's exact comparison
                    break
                yield entry.req
        source = self._lpm_order() if self.policy == "lpm" else self._dfs_order()
        for entry in source:
            if max_wait is None or not now - entry.arrival > max_wait:
                yield entry.req

    def _lpm_order(self) -> Iterator[WaitingEntry]:
        for key in self._bucket_keys:
            for item in self._buckets[key]:
                yield item[2]

    def _dfs_order(self) -> Iterator[WaitingEntry]:
        stack: list[tuple[TreeNode, bool]] = [(self.tree.root_node, False)]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                at = self._at.get(node)
                if at:
                    for matched in sorted(at, reverse=True):
                        for item in at[matched]:
                            yield item[2]
                continue
            stack.append((node, True))
            children = self._weighted_children.get(node)
            if children:
                ranked = sorted(children, key=lambda c: (-self._weight[c], c.order))
                stack.extend((c, False) for c in reversed(ranked))

    # ------------------------------------------------------------------ tree observer

    def on_new_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        waiting_for = self._next.get(parent, {}).get(leaf.key[0])
        if not waiting_for:
            return
        for entry in list(waiting_for):
            self._detach(entry, weights=False)
            node, matched = self._walk(entry.key, parent)
            assert node is leaf
            self._set_place(entry, node, matched)
            self._attach(entry, weights=False)
            self._move_weight(parent, leaf, 1)

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        at = self._at.get(lower)
        moving = [m for m in at if m <= upper.depth] if at else []
        moved = 0
        for matched in moving:
            for _, _, entry in list(at[matched]):
                self._detach(entry, weights=False)
                entry.node = upper
                self._attach(entry, weights=False)
                moved += 1
        if self.policy == "dfs-weight":
            weight = self._weight.get(lower, 0)
            if weight:
                parent = upper.parent
                self._weighted_children[parent].discard(lower)
                self._weighted_children[parent].add(upper)
                self._weight[upper] = weight
                self._weight[lower] = weight - moved
                if weight - moved:
                    self._weighted_children[upper] = {lower}
                else:
                    del self._weight[lower]

    def on_evict(self, leaf: TreeNode, parent: TreeNode) -> None:
        at = self._at.get(leaf)
        if at:
            for items in list(at.values()):
                for _, _, entry in list(items):
                    self._detach(entry, weights=False)
                    self._set_place(entry, parent, parent.depth)
                    self._attach(entry, weights=False)
        if self.policy == "dfs-weight" and self._weight.pop(leaf, 0):
            self._weighted_children[parent].discard(leaf)
        self._weighted_children.pop(leaf, None)
        self._at.pop(leaf, None)
        self._next.pop(leaf, None)

    def waiting_touch_time(self, leaf: TreeNode) -> int:
        return self.touch_tick if leaf in self._at else 0

    def on_reset(self) -> None:
        self.touch_tick = 0
        entries = list(self.entries.values())
        self._clear_structures()
        for entry in entries:
            entry.deprioritized = False
            entry.node = None
            self._set_place(entry, self.tree.root_node, 0)
            self._attach(entry, weights=True)

    # ------------------------------------------------------------------ internals

    def _walk(self, key: tuple[int, ...], node: TreeNode) -> tuple[TreeNode, int]:
        """Deepest match of `key` from `node` (fully matched), without splitting: (node whose edge holds the end, length)."""
        matched = node.depth
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            n = common_prefix_len(child.key, key, matched)
            node, matched = child, matched + n
            if n < len(child.key):
                break
        return node, matched

    def _is_short(self, entry: WaitingEntry) -> bool:
        return self.policy == "lpm" and entry.node is not None and entry.matched <= self.check_threshold

    def _is_grouped(self, entry: WaitingEntry) -> bool:
        d = self.deprioritize_threshold
        return self._is_short(entry) and d > 0 and len(entry.key) >= d

    def _set_place(self, entry: WaitingEntry, node: TreeNode, matched: int) -> None:
        """Move a detached entry to (node, matched), keeping the de-duplication groups current."""
        was_grouped = self._is_grouped(entry)
        entry.node, entry.matched = node, matched
        now_grouped = self._is_grouped(entry)
        if was_grouped and not now_grouped:
            self._group_leave(entry)
        elif now_grouped and not was_grouped:
            self._group_join(entry)
        elif not now_grouped:
            # D <= 0: every short request shares >= D tokens with the (empty) in-batch tree.
            entry.deprioritized = self._is_short(entry) and self.deprioritize_threshold <= 0

    def _group_join(self, entry: WaitingEntry) -> None:
        group = self._groups.setdefault(entry.key[: self.deprioritize_threshold], [])
        old_leader = group[0][2] if group else None
        _insort(group, entry)
        entry.deprioritized = group[0][2] is not entry
        if old_leader is not None and not entry.deprioritized:
            self._set_deprioritized(old_leader, True)

    def _group_leave(self, entry: WaitingEntry) -> None:
        prefix = entry.key[: self.deprioritize_threshold]
        group = self._groups[prefix]
        was_leader = group[0][2] is entry
        _remove(group, entry)
        entry.deprioritized = False
        if not group:
            del self._groups[prefix]
        elif was_leader:
            self._set_deprioritized(group[0][2], False)

    def _set_deprioritized(self, entry: WaitingEntry, value: bool) -> None:
        if entry.deprioritized != value:
            self._bucket_remove(entry)
            entry.deprioritized = value
            self._bucket_add(entry)

    def _attach(self, entry: WaitingEntry, weights: bool) -> None:
        node, matched = entry.node, entry.matched
        assert node is not None
        _insort(self._at.setdefault(node, {}).setdefault(matched, []), entry)
        if matched == node.depth and matched < len(entry.key):
            self._next.setdefault(node, {}).setdefault(entry.key[matched], {})[entry] = None
        if self.policy == "lpm":
            self._bucket_add(entry)
        elif weights:
            self._add_weight(node, 1)

    def _detach(self, entry: WaitingEntry, weights: bool) -> None:
        node, matched = entry.node, entry.matched
        assert node is not None
        at = self._at[node]
        _remove(at[matched], entry)
        if not at[matched]:
            del at[matched]
            if not at:
                del self._at[node]
        if matched == node.depth and matched < len(entry.key):
            by_token = self._next[node]
            del by_token[entry.key[matched]][entry]
            if not by_token[entry.key[matched]]:
                del by_token[entry.key[matched]]
                if not by_token:
                    del self._next[node]
        if self.policy == "lpm":
            self._bucket_remove(entry)
        elif weights:
            self._add_weight(node, -1)

    def _bucket_add(self, entry: WaitingEntry) -> None:
        key = (entry.deprioritized, -entry.matched)
        items = self._buckets.get(key)
        if items is None:
            items = self._buckets[key] = []
            bisect.insort(self._bucket_keys, key)
        _insort(items, entry)

    def _bucket_remove(self, entry: WaitingEntry) -> None:
        key = (entry.deprioritized, -entry.matched)
        items = self._buckets[key]
        _remove(items, entry)
        if not items:
            del self._buckets[key]
            self._bucket_keys.remove(key)

    def _add_weight(self, node: TreeNode | None, delta: int) -> None:
        """Change the subtree count of node and its ancestors (dfs-weight), tracking weighted children."""
        while node is not None:
            weight = self._weight.get(node, 0) + delta
            parent = node.parent
            if weight:
                self._weight[node] = weight
                if weight == delta and parent is not None:  # became weighted
                    self._weighted_children.setdefault(parent, set()).add(node)
            else:
                del self._weight[node]
                if parent is not None:
                    self._weighted_children[parent].discard(node)
            node = parent

    def _move_weight(self, parent: TreeNode, child: TreeNode, count: int) -> None:
        """Entries moved from parent itself into its child: only the child's count changes."""
        if self.policy != "dfs-weight":
            return
        weight = self._weight.get(child, 0) + count
        self._weight[child] = weight
        if weight == count:
            self._weighted_children.setdefault(parent, set()).add(child)

    def check(self) -> None:
        """AssertionError unless every attachment equals a fresh walk from the root (tests)."""
        assert [item[2] for item in self.fifo] == sorted(self.entries.values(), key=lambda e: (e.arrival, e.seq))
        if not self.tracks_tree:
            return
        for entry in self.entries.values():
            node, matched = self._walk(entry.key, self.tree.root_node)
            assert (entry.matched, entry.node) == (matched, node), (
                f"{entry.req.rid}: attached at {entry.node!r} with {entry.matched}, walk gives {node!r} with {matched}")
