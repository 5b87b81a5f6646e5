"""RadixCache: match/insert/split, locks, LRU eviction, and a randomized check against a flat reference.
(The request hooks cache_finished_req / cache_unfinished_req are in test_radix_cache_req_hooks.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from sgl_lite.runtime.mem_cache.memory_pool import SlotAllocator
from sgl_lite.runtime.mem_cache.radix_cache import RadixCache


class CheckedAllocator(SlotAllocator):
    """The real allocator, refusing a double free or a foreign slot (so a cache bug cannot hide)."""

    def free(self, slots: torch.Tensor) -> None:
        values = slots.tolist()
        assert len(set(values)) == len(values), f"slots freed twice in one call: {values}"
        assert all(1 <= v <= self.num_slots for v in values), f"freeing an invalid slot: {values}"
        already = set(self._free.tolist()) & set(values)
        assert not already, f"double free of slots {sorted(already)}"
        super().free(slots)


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_match_on_empty_tree_and_disabled_cache() -> None:
    cache = RadixCache(None, None)
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and m.last_node is cache.root_node
    disabled = RadixCache(None, None, disable=True)
    assert disabled.insert([1, 2, 3], slots(10, 11, 12)) == 0
    m = disabled.match_prefix([1, 2, 3])
    assert m.length == 0 and m.last_node is disabled.root_node
    assert disabled.total_size() == 0


def test_insert_returns_cached_prefix_length() -> None:
    cache = RadixCache(None, None)
    assert cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13)) == 0
    assert cache.insert([1, 2, 3, 4], slots(20, 21, 22, 23)) == 4  # identical key: all cached
    assert cache.insert([1, 2, 9], slots(30, 31, 32)) == 2  # diverges mid-edge: split
    assert cache.insert([1, 2, 3, 4, 5, 6], slots(40, 41, 42, 43, 44, 45)) == 4
    assert cache.insert([7], slots(50)) == 0
    assert cache.total_size() == 4 + 1 + 2 + 1
    # The tree kept its first slots for shared tokens.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == [10, 11, 12, 13, 44, 45]
    assert cache.match_prefix([1, 2, 9]).slots.tolist() == [10, 11, 32]
    cache.check_integrity()


def test_match_ending_mid_edge_splits_node() -> None:
    cache = RadixCache(None, None)
    cache.insert([1, 2, 3, 4, 5], slots(10, 11, 12, 13, 14))
    leaf = cache.match_prefix([1, 2, 3, 4, 5]).last_node
    nodes_before = cache.num_nodes()
    m = cache.match_prefix([1, 2, 3, 8])
    assert m.slots.tolist() == [10, 11, 12]
    assert m.last_node.key == (1, 2, 3) and m.last_node.parent is cache.root_node
    assert cache.num_nodes() == nodes_before + 1
    # The old node keeps its identity as the lower half, so a holder of it still means the full prefix.
    assert leaf.key == (4, 5) and leaf.parent is m.last_node
    assert cache.match_prefix([1, 2, 3, 4, 5]).last_node is leaf
    # A match ending exactly on the boundary splits nothing.
    assert cache.match_prefix([1, 2, 3]).last_node is m.last_node
    assert cache.num_nodes() == nodes_before + 1
    assert cache.total_size() == 5
    cache.check_integrity()


def test_locks_move_sizes_and_protect_from_eviction() -> None:
    alloc = CheckedAllocator(16)
    cache = RadixCache(alloc, None)
    a, b = alloc.alloc(4), alloc.alloc(3)
    cache.insert([1, 2, 3, 4], a)
    cache.insert([1, 2, 7], b)
    alloc.free(b[:2])  # duplicates of the cached [1, 2]
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    assert cache.inc_lock_ref(node) == 4  # path [1,2] + [3,4]
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    assert cache.inc_lock_ref(node) == 0  # already protected
    assert cache.evict(100) == 1  # only the unlocked [7] leaf can go
    assert cache.match_prefix([1, 2, 7]).length == 2
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == -4
    assert (cache.evictable_size(), cache.protected_size()) == (4, 0)
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock_ref(node)
    assert cache.evict(100) == 4
    assert alloc.available_size == 16 and cache.total_size() == 0
    with pytest.raises(ValueError, match="no longer in the tree"):
        cache.inc_lock_ref(node)
    cache.check_integrity()


def cached_len(cache: RadixCache, key: list[int]) -> int:
    """Longest cached prefix of key, found by walking the tree without touching access times."""
    node, n = cache.root_node, 0
    while n < len(key) and key[n] in node.children:
        node = node.children[key[n]]
        edge = list(node.key)
        if key[n : n + len(edge)] != edge:
            return n + next(i for i, t in enumerate(edge) if n + i >= len(key) or key[n + i] != t)
        n += len(edge)
    return n


def test_evict_is_lru_and_cascades_to_parents() -> None:
    alloc = CheckedAllocator(32)
    cache = RadixCache(alloc, None)
    for key in ([1, 2, 3], [1, 2, 4], [5, 6], [5, 7]):
        s = alloc.alloc(len(key))
        alloc.free(s[: cache.insert(key, s)])
    # Access order, oldest first: [5,6], [5,7], [1,2,3], [1,2,4]. Node [5] was last used by [5,7].
    for key in ([5, 6], [5, 7], [1, 2, 3], [1, 2, 4]):
        cache.match_prefix(key)
    assert cache.evict(1) == 1
    assert [cached_len(cache, k) for k in ([5, 6], [5, 7], [1, 2, 3], [1, 2, 4])] == [1, 2, 3, 3]
    # Evicting [5,7]'s leaf makes [5] a leaf older than [1,2,3]: it goes in the same call.
    assert cache.evict(2) == 2
    assert [cached_len(cache, k) for k in ([5], [1, 2, 3], [1, 2, 4])] == [0, 3, 3]
    cache.match_prefix([1, 2, 3])  # now [4] is the oldest leaf
    assert cache.evict(1) == 1
    assert [cached_len(cache, k) for k in ([1, 2, 3], [1, 2, 4])] == [3, 2]
    assert cache.evict(2) == 3  # leaf [3], then its parent [1,2] as a whole
    assert cache.total_size() == 0 and alloc.available_size == 32
    assert cache.evict(1) == 0
    cache.check_integrity()


def test_evict_frees_whole_leaves_and_stops_when_enough() -> None:
    alloc = CheckedAllocator(32)
    cache = RadixCache(alloc, None)
    for key in ([1] * 5, [2] * 5, [3] * 5):
        cache.insert(key, alloc.alloc(5))
    assert cache.evict(6) == 10  # two whole leaves, not a third
    assert cache.total_size() == 5 and alloc.available_size == 32 - 5
    cache.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    cache = RadixCache(CheckedAllocator(8), None)
    cache.insert([1, 2, 3], slots(1, 2, 3))
    cache.check_integrity()
    cache._evictable_size += 1
    with pytest.raises(AssertionError, match="evictable_size"):
        cache.check_integrity()
    cache._evictable_size -= 1
    cache.insert([4, 5], slots(6, 3))  # slot 3 is already on another node
    with pytest.raises(AssertionError, match="two nodes"):
        cache.check_integrity()


class Reference:
    """Flat model of the cache: every cached prefix -> (slot of its last token, last access tick)."""

    def __init__(self) -> None:
        self.slot: dict[tuple[int, ...], int] = {}
        self.time: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[int, ...]] = []
        self.tick = 0

    def match_len(self, key: tuple[int, ...]) -> int:
        n = 0
        while n < len(key) and key[: n + 1] in self.slot:
            n += 1
        return n

    def touch(self, key: tuple[int, ...], n: int) -> None:
        self.tick += 1
        for i in range(1, n + 1):
            self.time[key[:i]] = self.tick

    def protected(self) -> set[tuple[int, ...]]:
        return {lock[:i] for lock in self.locks for i in range(1, len(lock) + 1)}

    def unlocked_leaves(self) -> list[tuple[int, ...]]:
        has_child = {p[:-1] for p in self.slot}
        prot = self.protected()
        return [p for p in self.slot if p not in has_child and p not in prot]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_against_reference(seed: int) -> None:
    rng = random.Random(seed)
    alloc = CheckedAllocator(120)
    cache = RadixCache(alloc, None)
    ref = Reference()
    held: list[tuple[object, tuple[int, ...]]] = []  # (locked node, its prefix)
    known: list[tuple[int, ...]] = [()]

    def evict_and_check(want: int) -> None:
        evictable_before = cache.evictable_size()
        got = cache.evict(want)
        removed = {p for p in ref.slot if cached_len(cache, list(p)) < len(p)}
        assert got == len(removed)
        assert got >= min(want, evictable_before)
        assert not removed & ref.protected(), "a locked prefix was evicted"
        for p in removed:
            del ref.slot[p]
        if removed:
            # LRU: nothing evicted is newer than a surviving unlocked leaf.
            newest_removed = max(ref.time[p] for p in removed)
            assert all(ref.time[p] >= newest_removed for p in ref.unlocked_leaves())
        for p in removed:
            del ref.time[p]

    def random_key() -> tuple[int, ...]:
        base = rng.choice(known)[: rng.randint(0, 12)]
        return base + tuple(rng.randint(0, 3) for _ in range(rng.randint(0 if base else 1, 8)))

    for _ in range(700):
        op = rng.random()
        if op < 0.35:
            key = random_key()
            need = len(key)
            if alloc.available_size < need:
                evict_and_check(need - alloc.available_size)
            new = alloc.alloc(need)
            if new is None:
                continue
            expected = ref.match_len(key)
            got = cache.insert(key, new)
            assert got == expected
            alloc.free(new[:got])
            for i in range(got, len(key)):
                ref.slot[key[: i + 1]] = int(new[i])
            ref.touch(key, len(key))
            known.append(key)
        elif op < 0.65:
            key = random_key()
            m = cache.match_prefix(key)
            n = ref.match_len(key)
            assert m.length == n
            assert m.slots.tolist() == [ref.slot[key[: i + 1]] for i in range(n)]
            ref.touch(key, n)
            if n and rng.random() < 0.5:
                before = len(ref.protected())
                delta = cache.inc_lock_ref(m.last_node)
                ref.locks.append(key[:n])
                held.append((m.last_node, key[:n]))
                assert delta == len(ref.protected()) - before
        elif op < 0.8 and held:
            node, prefix = held.pop(rng.randrange(len(held)))
            before = len(ref.protected())
            ref.locks.remove(prefix)
            assert cache.dec_lock_ref(node) == len(ref.protected()) - before
        else:
            evict_and_check(rng.randint(1, 30))
        assert cache.total_size() == len(ref.slot)
        assert cache.protected_size() == len(ref.protected())
        assert alloc.available_size + cache.evictable_size() + cache.protected_size() == alloc.num_slots
        cache.check_integrity()
    for node, _ in held:
        cache.dec_lock_ref(node)
    cache.evict(alloc.num_slots)
    assert cache.total_size() == 0 and alloc.available_size == alloc.num_slots
