"""Session pins in the radix tree (mem_cache/session_pins.py): a pinned leaf is evicted only after every unpinned
one, pinned leaves go least recently used first when nothing else is left (a pin never makes the pool refuse),
the pin of an evicted leaf retreats to its parent, and releasing, expiring, bounding and resetting pins works."""

from __future__ import annotations

import pytest
import torch

from sgl_lite.runtime.mem_cache.memory_pool import SlotAllocator
from sgl_lite.runtime.mem_cache.radix_cache import RadixCache
from sgl_lite.runtime.mem_cache.session_pins import SessionPins


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cache(num_slots: int = 64, clock: Clock | None = None) -> RadixCache:
    cache = RadixCache(SlotAllocator(num_slots, torch.device("cpu")), None)
    if clock is not None:
        cache.pins = SessionPins(clock=clock)
    return cache


def _put(cache: RadixCache, key: list[int]) -> None:
    """Insert `key` with fresh slots for the tokens the tree does not hold yet (as a finished request does)."""
    slots = cache.allocator.alloc(len(key))
    assert slots is not None
    cached = cache.insert(key, slots)
    cache.allocator.free(slots[:cached])


def _cached(cache: RadixCache, key: list[int]) -> int:
    return cache.match_prefix(key).length


def _pin(cache: RadixCache, session: str, key: list[int], idle_timeout_s: float = 60.0) -> None:
    cache.pins.pin(session, cache.match_prefix(key).last_node, idle_timeout_s)


SESSION, OTHER, ONE_OFF = [1, 2, 3, 4, 5, 6], [20, 21, 22, 23, 24, 25], [40, 41, 42, 43]


def test_a_pinned_prefix_outlives_newer_unpinned_ones() -> None:
    cache = _cache()
    _put(cache, SESSION)  # the oldest: plain LRU would evict it first
    _pin(cache, "s", SESSION)
    _put(cache, OTHER)
    _put(cache, ONE_OFF)
    assert cache.evict(len(OTHER) + len(ONE_OFF)) == len(OTHER) + len(ONE_OFF)
    assert _cached(cache, SESSION) == len(SESSION)
    assert _cached(cache, OTHER) == 0 and _cached(cache, ONE_OFF) == 0
    cache.check_integrity()


def test_only_pinned_leaves_left_are_evicted_lru_and_a_pin_retreats_to_the_parent() -> None:
    cache = _cache()
    _put(cache, SESSION)
    _pin(cache, "s", SESSION)
    _put(cache, OTHER)
    _pin(cache, "t", OTHER)  # pinned later: the more recent of the two
    _put(cache, SESSION[:2] + [9])  # an unpinned branch: splits the pinned edge after two tokens
    pinned = cache.pins.node_of("s")
    assert pinned is not None and pinned.key == tuple(SESSION[2:])  # the pin stays on the lower half
    evictable = cache.evictable_size()
    assert cache.evict(1 + len(SESSION) - 2) == 1 + len(SESSION) - 2  # the branch, then the older pinned leaf
    assert _cached(cache, SESSION) == 2 and _cached(cache, OTHER) == len(OTHER)
    retreated = cache.pins.node_of("s")
    assert pinned.evicted and retreated is not None and retreated.key == tuple(SESSION[:2])
    assert cache.evictable_size() == evictable - (1 + len(SESSION) - 2)
    cache.check_integrity()
    # Nothing but pinned leaves: the pool still gives every token, and the pins at the root are dropped.
    assert cache.evict(cache.evictable_size()) == 2 + len(OTHER)
    assert len(cache.pins) == 0 and cache.total_size() == 0
    assert cache.allocator.available_size == cache.allocator.num_slots
    cache.check_integrity()


def test_a_released_pin_leaves_its_path_to_lru() -> None:
    cache = _cache()
    _put(cache, SESSION)
    _pin(cache, "s", SESSION)
    _put(cache, OTHER)
    assert cache.pins.release("s") and not cache.pins.release("s")
    assert cache.evict(1) == len(SESSION)  # the oldest leaf again
    assert _cached(cache, SESSION) == 0 and _cached(cache, OTHER) == len(OTHER)
    cache.check_integrity()


def test_a_new_pin_of_a_session_replaces_its_old_one() -> None:
    cache = _cache()
    _put(cache, SESSION)
    _pin(cache, "s", SESSION)
    _put(cache, OTHER)
    _pin(cache, "s", OTHER)
    assert len(cache.pins) == 1 and not cache.pins.holds(cache.match_prefix(SESSION).last_node)
    assert cache.evict(1) == len(SESSION)
    cache.check_integrity()


def test_pins_expire_after_their_idle_timeout() -> None:
    clock = Clock()
    cache = _cache(clock=clock)
    _put(cache, SESSION)
    _pin(cache, "s", SESSION, idle_timeout_s=10.0)
    _put(cache, OTHER)
    clock.now = 9.0
    assert cache.evict(1) == len(OTHER)  # still pinned
    _put(cache, OTHER)
    clock.now = 10.5
    assert cache.evict(1) == len(SESSION) and len(cache.pins) == 0
    cache.check_integrity()


def test_pins_are_bounded_and_dropped_with_the_tree() -> None:
    pins = SessionPins(max_pins=2)
    cache = _cache()
    cache.pins = pins
    for key, session in ((SESSION, "a"), (OTHER, "b"), (ONE_OFF, "c")):
        _put(cache, key)
        _pin(cache, session, key)
    assert len(pins) == 2 and pins.node_of("a") is None  # the least recently set went
    cache.reset()
    cache.allocator.clear()
    assert len(pins) == 0
    with pytest.raises(ValueError, match="max_pins"):
        SessionPins(max_pins=0)
    with pytest.raises(ValueError, match="below the root"):
        pins.pin("r", cache.root_node, 1.0)
