"""Open sessions' prefixes pinned in the radix tree: the KV of a session's latest finished request is evicted
only after every unpinned leaf (RadixCache.evict), so that the session's next turn still finds its prefix
while one-off requests fill the pool.

A pin names one node, the end of that request's KV; the path above it is pinned through it. A node above a
pinned one has it as a descendant, so it is never a leaf while the pin holds: a leaf is pinned exactly when
a pin names it, and no count along the path is needed. A split keeps the pinned node object on the lower
half, the pin's end, so splits change nothing either.

A pin is not a lock: its tokens stay in evictable_size, and a pool with only pinned leaves left evicts
them, least recently used first, rather than fail a request. The pin on an evicted leaf moves to its
parent (at the root it is dropped), so the session keeps what is left of its prefix.

Bounded: at most `max_pins` pins (a new one drops the least recently set beyond that), each dropped
`idle_timeout_s` after it was set unless set again; releasing one (the session closed) makes its path
ordinary LRU again. Keys are session ids, one namespace per runtime as in SGLang.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from sgl_lite.runtime.mem_cache.radix_cache import TreeNode

MAX_SESSION_PINS = 1024


@dataclass
class _Pin:
    node: TreeNode
    expires_at: float


class SessionPins:
    def __init__(self, max_pins: int = MAX_SESSION_PINS, clock: Callable[[], float] = time.monotonic) -> None:
        if max_pins < 1:
            raise ValueError(f"max_pins must be >= 1; got {max_pins}")
        self.max_pins = max_pins
        self.clock = clock
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # by key, least recently set first
        self._keys_by_node: dict[TreeNode, set[str]] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def holds(self, node: TreeNode) -> bool:
        """Whether a pin names `node` (for a leaf: whether it is pinned)."""
        return node in self._keys_by_node

    def node_of(self, key: str) -> TreeNode | None:
        pin = self._pins.get(key)
        return pin.node if pin is not None else None

    def nodes(self) -> list[TreeNode]:
        return list(self._keys_by_node)

    def pin(self, key: str, node: TreeNode, idle_timeout_s: float) -> None:
        """Pin the path to `node` for `key`, replacing the key's earlier pin."""
        if node.parent is None:
            raise ValueError("a pin names a node below the root")
        self.release(key)
        self._pins[key] = _Pin(node, self.clock() + idle_timeout_s)
        self._keys_by_node.setdefault(node, set()).add(key)
        while len(self._pins) > self.max_pins:
            self.release(next(iter(self._pins)))

    def release(self, key: str) -> bool:
        """Drop the pin of `key`; False when it has none."""
        pin = self._pins.pop(key, None)
        if pin is None:
            return False
        keys = self._keys_by_node[pin.node]
        keys.discard(key)
        if not keys:
            del self._keys_by_node[pin.node]
        return True

    def drop_expired(self) -> None:
        now = self.clock()
        for key in [key for key, pin in self._pins.items() if pin.expires_at <= now]:
            self.release(key)

    def on_evict(self, leaf: TreeNode, parent: TreeNode) -> None:
        """`leaf` left the tree: its pins move up to `parent`, or are dropped when that is the root."""
        keys = self._keys_by_node.pop(leaf, None)
        if not keys:
            return
        if parent.parent is None:
            for key in keys:
                del self._pins[key]
            return
        self._keys_by_node.setdefault(parent, set()).update(keys)
        for key in keys:
            self._pins[key].node = parent

    def clear(self) -> None:
        self._pins.clear()
        self._keys_by_node.clear()
