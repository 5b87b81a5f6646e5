"""RadixCache's self-check and debug view: every invariant of the tree recounted from scratch, and the tree as
indented text. Kept apart from the tree's operations; `RadixCache.check_integrity` and `pretty_print` call them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sgl_lite.runtime.mem_cache.radix_cache import RadixCache


def check_integrity(cache: RadixCache) -> None:
    """Raise AssertionError naming the first broken invariant (see radix_cache.py's docstring)."""
    evictable = protected = count = 0
    seen: list[torch.Tensor] = []
    for node in cache.iter_nodes():
        count += 1
        assert node.lock_ref >= 0, f"{node!r} has negative lock_ref"
        assert not node.evicted, f"{node!r} is in the tree but marked evicted"
        for first, child in node.children.items():
            assert child.parent is node, f"{child!r} has a wrong parent pointer"
            assert child.key and child.key[0] == first, f"{child!r} stored under {first}, key starts {child.key[:1]}"
            if node is not cache.root_node:
                assert node.lock_ref >= child.lock_ref, f"{node!r} has a smaller lock_ref than child {child!r}"
        if node is cache.root_node:
            continue
        assert len(node.value) == len(node.key), f"{node!r} has {len(node.value)} slots for {len(node.key)} tokens"
        assert node.parent is not None and node.depth == node.parent.depth + len(node.key), f"{node!r} has a wrong depth"
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
        seen.append(node.value)
    assert count == cache._num_nodes, f"node count {cache._num_nodes} but the tree has {count}"
    assert evictable == cache._evictable_size, f"evictable_size {cache._evictable_size} but recount {evictable}"
    assert protected == cache._protected_size, f"protected_size {cache._protected_size} but recount {protected}"
    if cache.allocator is not None and seen:
        slots = torch.cat(seen)
        unique = torch.unique(slots)
        assert unique.numel() == slots.numel(), f"{slots.numel() - unique.numel()} slot(s) appear on two nodes"
        assert int(slots.min()) >= 1 and int(slots.max()) <= cache.allocator.num_slots, "tree holds an invalid slot"
    for node in cache.pins.nodes():
        assert not node.evicted and node.parent is not None, f"a session pin names {node!r}, which is not in the tree"

def pretty_print(cache: RadixCache) -> str:
    lines = [f"RadixCache(nodes={cache._num_nodes}, evictable={cache._evictable_size}, protected={cache._protected_size})"]
    stack = [(child, 1) for child in reversed(list(cache.root_node.children.values()))]
    while stack:
        node, depth = stack.pop()
        shown = list(node.key[:8]) + (["..."] if len(node.key) > 8 else [])
        lines.append(
            f"{'  ' * depth}#{node.id} {shown} len={len(node.key)} lock={node.lock_ref} t={node.last_access_time}"
        )
        stack.extend((child, depth + 1) for child in reversed(list(node.children.values())))
    return "\n".join(lines)
