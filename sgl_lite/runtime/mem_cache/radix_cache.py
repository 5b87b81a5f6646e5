"""RadixAttention: a radix tree over token ids whose values are KV slot indices (page size 1).

Every edge holds a run of tokens (`key`) and the slots of their KV (`value`, same length). A
request's cached prefix is the path from the root to its `last_node`; the request pins that path
with `inc_lock_ref` so it cannot be evicted while the request uses it.

Invariants (checked by `check_integrity`):
- a child is stored under the first token of its edge; no two children share a first token;
- every non-root node has a non-empty key and a value of the same length;
- a node's lock_ref counts the locks taken on it or on any node below it, so a parent's
  lock_ref is >= each child's, and only unlocked leaves can be evicted;
- evictable_size = tokens on unlocked nodes, protected_size = tokens on locked nodes (the root
  holds no tokens and never counts); both are kept incrementally;
- no slot appears on two nodes (with an allocator: the tree owns each of its slots once).

All tokens of one node always share their access history: a match or insert that ends inside an
edge splits it first. So LRU per node is LRU per token.

Open sessions' latest prefixes are pinned (`pins`, session_pins.py): eviction takes pinned leaves only
after every unpinned one.

An optional `TreeObserver` (tree_observer.py) hears about every structural change (new leaf, split, eviction, reset),
so that an index of waiting requests (waiting_index.py) can follow the tree without re-matching.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache import tree_checks
from sgl_lite.runtime.mem_cache.memory_pool import ReqToTokenPool, SlotAllocator
from sgl_lite.runtime.mem_cache.session_pins import SessionPins

if TYPE_CHECKING:
    from sgl_lite.runtime.mem_cache.tree_observer import TreeObserver

logger = logging.getLogger(__name__)


class TreeNode:
    """One edge of the tree and the node it leads to. Hashed by identity (policies key dicts by node)."""

    __slots__ = ("id", "children", "parent", "key", "value", "lock_ref", "last_access_time", "evicted", "depth", "order")

    def __init__(self, node_id: int, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.id = node_id  # stable for the node's lifetime (a split keeps it on the lower half)
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = 0
        self.evicted = False  # set when evicted or dropped by reset(); such a node must not be locked
        self.depth = (parent.depth if parent is not None else 0) + len(key)  # tokens from the root to this node's end
        # Rank among its siblings in parent.children's (insertion) order: a new leaf gets the next
        # number, the upper half of a split takes over the lower half's (it takes its dict entry too).
        self.order = node_id

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    slots: torch.Tensor  # slots of the matched prefix, in token order
    last_node: TreeNode  # the node whose path from the root is exactly the matched prefix

    @property
    def length(self) -> int:
        return int(self.slots.numel())


class RadixCache:
    def __init__(
        self,
        allocator: SlotAllocator | None,
        req_to_token: ReqToTokenPool | None,
        disable: bool = False,
    ) -> None:
        self.allocator = allocator  # None = pool-free mode: slots are opaque, evict frees nothing
        self.req_to_token = req_to_token
        self.disable = disable
        self.device = allocator.device if allocator is not None else torch.device("cpu")
        self.observer: TreeObserver | None = None
        # Called with each leaf about to be evicted, its KV and its path's still in the pool (the disk tier's
        # write_back spill).
        self.before_evict: Callable[[TreeNode], None] | None = None
        self.pins = SessionPins()
        self.reset()

    # ---------------------------------------------------------------- state

    def reset(self) -> None:
        """Drop the whole tree. Frees no slot: the caller clears the allocator too (flush when idle)."""
        if getattr(self, "root_node", None) is not None:
            for node in self.iter_nodes():
                node.evicted = True
        self._next_id = 0
        self._tick = 0
        self.root_node = self._new_node((), self._empty(), None)
        self._evictable_size = 0
        self._protected_size = 0
        self._num_nodes = 1
        self.pins.clear()
        if self.observer is not None:
            self.observer.on_reset()

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def num_nodes(self) -> int:
        return self._num_nodes

    # ---------------------------------------------------------------- match / insert

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `key`. Splits the last edge so `last_node` ends exactly at the match."""
        if self.disable or len(key) == 0:
            return MatchResult(self._empty(), self.root_node)
        key = tuple(key)
        tick = self.next_tick()
        node, pos, values = self.root_node, 0, []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, key, pos)
            ends_mid_edge = n < len(child.key)
            if ends_mid_edge:
                child = self._split(child, n)
            child.last_access_time = tick
            values.append(child.value)
            node, pos = child, pos + n
            if ends_mid_edge:
                break
        slots = torch.cat(values) if values else self._empty()
        return MatchResult(slots, node)

    def insert(self, key: Sequence[int], slots: torch.Tensor) -> int:
        """Insert `key` -> `slots`; return how many leading tokens were already cached.

        The tree keeps its own slots for those leading tokens, so `slots[:returned]` are duplicates
        the caller must free (unless they are the tree's own, i.e. a prefix it got from a match).
        """
        if len(slots) != len(key):
            raise ValueError(f"insert: key has {len(key)} tokens but slots has {len(slots)} entries")
        if self.disable or len(key) == 0:
            return 0
        key = tuple(key)
        tick = self.next_tick()
        node, pos = self.root_node, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = self._new_node(key[pos:], slots[pos:].clone(), node)
                leaf.last_access_time = tick
                node.children[key[pos]] = leaf
                self._evictable_size += len(leaf.key)
                self._num_nodes += 1
                if self.observer is not None:
                    self.observer.on_new_leaf(leaf)
                return pos
            n = common_prefix_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = tick
            node, pos = child, pos + n
        return pos

    # ---------------------------------------------------------------- locks / eviction

    def unlocked_length(self, node: TreeNode | None) -> int:
        """Tokens of the path root..node that nothing locks: what inc_lock_ref(node) moves out of
        evictable_size."""
        length = 0
        while node is not None and node is not self.root_node:
            if node.lock_ref == 0:
                length += len(node.key)
            node = node.parent
        return length

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock the path root..node; return the increase of protected_size."""
        if node is not None and node.evicted:
            raise ValueError(f"inc_lock_ref on {node!r}, which is no longer in the tree (match again)")
        delta = 0
        while node is not None and node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta += len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Unlock the path root..node; return the change of protected_size (<= 0)."""
        if node is not None and node is not self.root_node and node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on {node!r}, which is not locked")
        delta = 0
        while node is not None and node is not self.root_node:
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta -= len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, unpinned before pinned, least recently used first, until >= num_tokens are
        gone (or none is left)."""
        if self.disable or num_tokens <= 0:
            return 0
        self.pins.drop_expired()
        heap = [(self.pins.holds(n), self._lru_time(n), n.id, n) for n in self.iter_nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            if self.before_evict is not None:
                self.before_evict(leaf)
            del parent.children[leaf.key[0]]
            if self.allocator is not None:
                self.allocator.free(leaf.value)
            evicted += len(leaf.key)
            self._evictable_size -= len(leaf.key)
            self._num_nodes -= 1
            leaf.evicted, leaf.parent = True, None
            self.pins.on_evict(leaf, parent)
            if self.observer is not None:
                self.observer.on_evict(leaf, parent)
            # A parent's access time is >= its children's (and it inherits their waiting requests), and a pinned
            # child's pin moved to it, so pops stay in (pinned, LRU) order.
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (self.pins.holds(parent), self._lru_time(parent), parent.id, parent))
        return evicted

    # ---------------------------------------------------------------- request integration

    def cache_finished_req(self, req: Req) -> None:
        """Give a finished (or retracted) request's KV to the tree and unlock its prefix.

        Afterwards every slot of `row[:kv_len]` is owned by the tree or freed; req.last_node is None.
        Slots beyond kv_len and the row itself stay the scheduler's to free.
        """
        row = self._row(req)
        if self.disable:
            self._free(row[: req.kv_len].clone())
            req.last_node = None
            return
        cached = self.insert(req.fill_ids[: req.kv_len], row[: req.kv_len])
        # The locked prefix is the tree's; tokens [prefix_len, cached) were cached meanwhile under other
        # slots, so the request's own copies are duplicates; from `cached` on the tree took its slots.
        assert cached >= req.prefix_len, f"request {req.rid!r}: its locked prefix is not in the tree"
        self._free(row[req.prefix_len : cached])
        self.dec_lock_ref(req.last_node)
        req.last_node = None

    def cache_unfinished_req(self, req: Req, borrowed: int = 0) -> None:
        """After a prefill chunk: cache the computed tokens and make the row point at the tree's slots.

        Sets req.prefix_len = req.kv_len and moves the request's lock to the new last node.
        `borrowed`: row[prefix_len : prefix_len + borrowed] holds slots of other requests of the same
        batch (in-batch sharing), already in the tree by now; they are never this request's to free.
        """
        if self.disable:
            return
        row = self._row(req)
        key = req.fill_ids[: req.kv_len]
        self.insert(key, row[: req.kv_len])
        match = self.match_prefix(key)
        assert match.length == req.kv_len, "a just-inserted key must match in full"
        self._free_own_duplicates(req, row, match.slots, borrowed)
        row[: req.kv_len] = match.slots
        # Lock the new path before unlocking the old one, so the shared part never looks evictable.
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.prefix_len = req.kv_len

    def _row(self, req: Req) -> torch.Tensor:
        if self.req_to_token is None or req.req_pool_idx is None:
            raise ValueError(f"request {req.rid!r} has no req_to_token row (req_pool_idx={req.req_pool_idx})")
        if not 0 <= req.prefix_len <= req.kv_len <= len(req.fill_ids):
            raise ValueError(
                f"request {req.rid!r}: need 0 <= prefix_len <= kv_len <= len(fill_ids); "
                f"got {req.prefix_len}, {req.kv_len}, {len(req.fill_ids)}"
            )
        return self.req_to_token.table[req.req_pool_idx]

    def _free_own_duplicates(self, req: Req, row: torch.Tensor, tree_slots: torch.Tensor, borrowed: int = 0) -> None:
        """Free the request's own slots (past prefix_len + borrowed) for tokens the tree already held
        under other slots."""
        p = req.prefix_len
        assert torch.equal(row[:p], tree_slots[:p]), f"request {req.rid!r}: its locked prefix is not the tree's"
        own_start = p + borrowed
        own = row[own_start : req.kv_len]
        self._free(own[own != tree_slots[own_start:]])

    def _free(self, slots: torch.Tensor) -> None:
        if self.allocator is not None and slots.numel():
            self.allocator.free(slots.clone())

    # ---------------------------------------------------------------- checks / debug

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (see the module docstring)."""
        tree_checks.check_integrity(self)

    def pretty_print(self) -> str:
        return tree_checks.pretty_print(self)

    # ---------------------------------------------------------------- internals

    def _new_node(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        node = TreeNode(self._next_id, key, value, parent)
        self._next_id += 1
        return node

    def next_tick(self) -> int:
        """A fresh access time, later than every access so far."""
        self._tick += 1
        return self._tick

    def _lru_time(self, node: TreeNode) -> int:
        if self.observer is None:
            return node.last_access_time
        return max(node.last_access_time, self.observer.waiting_touch_time(node))

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's edge after n tokens; return the new upper node. Sizes do not change."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = self._new_node(child.key[:n], child.value[:n], parent)
        upper.lock_ref = child.lock_ref  # every lock through child also passes through upper
        upper.last_access_time = child.last_access_time
        upper.order = child.order
        upper.children[child.key[n]] = child
        parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        self._num_nodes += 1
        if self.observer is not None:
            self.observer.on_split(upper, child)
        return upper

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root_node and not node.children and node.lock_ref == 0

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node of the tree, the root first, each once (depth first; the tree must not change meanwhile)."""
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def common_prefix_len(edge: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `edge` and `key[start:]`."""
    n = min(len(edge), len(key) - start)
    if key[start : start + n] == edge[:n]:
        return n
    i = 0
    while edge[i] == key[start + i]:
        i += 1
    return i
