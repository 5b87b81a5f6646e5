"""The interface through which an index of waiting requests follows the radix tree without re-matching.

RadixCache (radix_cache.py) calls its observer right after every structural change; the waiting index
(managers/waiting_index.py) is the one implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sgl_lite.runtime.mem_cache.radix_cache import TreeNode


class TreeObserver(Protocol):
    """Told about every structural change of a RadixCache, right after it happened."""

    def on_new_leaf(self, leaf: TreeNode) -> None: ...

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """`lower` (same object as before) now hangs below the new `upper`, which took its place."""

    def on_evict(self, leaf: TreeNode, parent: TreeNode) -> None:
        """`leaf` was removed from `parent.children`."""

    def on_reset(self) -> None: ...

    def waiting_touch_time(self, leaf: TreeNode) -> int:
        """The access time waiting requests matched into `leaf` give it (0: none). SGLang re-matches
        every waiting request each step, which refreshes their prefixes' LRU time; an observer that
        spares those matches reports the time of its last ordering instead, so eviction is the same."""
