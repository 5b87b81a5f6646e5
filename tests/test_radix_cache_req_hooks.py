"""RadixCache request hooks: cache_finished_req / cache_unfinished_req on real pools, and bad-call errors."""

from __future__ import annotations

import pytest
import torch
from test_radix_cache import CheckedAllocator, slots

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.memory_pool import ReqToTokenPool, SlotAllocator
from sgl_lite.runtime.mem_cache.radix_cache import RadixCache
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.testing.req_factory import make_req


def admit(cache: RadixCache, pool: ReqToTokenPool, req: Req) -> None:
    """What the scheduler does on admission: match, lock, copy the prefix slots into the row."""
    m = cache.match_prefix(req.fill_ids)
    cache.inc_lock_ref(m.last_node)
    req.last_node = m.last_node
    req.prefix_len = req.kv_len = m.length
    pool.table[req.req_pool_idx, : m.length] = m.slots


def compute(alloc: SlotAllocator, pool: ReqToTokenPool, req: Req, n: int) -> torch.Tensor:
    """What a forward does to the KV state: n more tokens get fresh slots."""
    new = alloc.alloc(n)
    assert new is not None
    pool.table[req.req_pool_idx, req.kv_len : req.kv_len + n] = new
    req.kv_len += n
    return new


def test_cache_finished_req_frees_duplicates_and_unlocks() -> None:
    alloc, pool = CheckedAllocator(64), ReqToTokenPool(4, 32)
    cache = RadixCache(alloc, pool)
    shared = [5, 6, 7, 8]
    a = make_req("a", shared + [1, 1], req_pool=pool, max_new_tokens=4)
    b = make_req("b", shared + [2, 2, 2], req_pool=pool, max_new_tokens=4)
    admit(cache, pool, a)
    admit(cache, pool, b)  # both miss: the tree is empty
    compute(alloc, pool, a, 6)
    a.output_ids = [9]  # sampled, KV not yet computed
    b_slots = compute(alloc, pool, b, 7)
    cache.cache_finished_req(a)
    assert a.last_node is None
    assert cache.total_size() == 6 and cache.protected_size() == 0
    free_before = alloc.available_size
    cache.cache_finished_req(b)  # b's own slots for the shared 4 tokens are duplicates now
    assert alloc.available_size == free_before + 4
    assert set(b_slots[:4].tolist()) <= set(alloc._free.tolist())
    m = cache.match_prefix(shared + [2, 2, 2])
    assert m.length == 7 and m.slots[4:].tolist() == b_slots[4:].tolist()
    assert cache.match_prefix(a.fill_ids).length == 6  # the un-computed output token is not cached
    for r in (a, b):
        pool.free(r.req_pool_idx)
    assert alloc.available_size + cache.total_size() == alloc.num_slots
    cache.check_integrity()


def test_cache_finished_req_keeps_locked_prefix_and_handles_disable() -> None:
    alloc, pool = CheckedAllocator(64), ReqToTokenPool(4, 32)
    cache = RadixCache(alloc, pool)
    first = make_req("first", [1, 2, 3, 4], req_pool=pool, max_new_tokens=4)
    admit(cache, pool, first)
    compute(alloc, pool, first, 4)
    cache.cache_finished_req(first)
    second = make_req("second", [1, 2, 3, 4, 5, 6], req_pool=pool, max_new_tokens=4)
    admit(cache, pool, second)
    assert second.prefix_len == 4 and cache.protected_size() == 4
    compute(alloc, pool, second, 2)
    assert cache.evict(100) == 0  # the shared prefix is locked
    cache.cache_finished_req(second)
    assert cache.protected_size() == 0 and cache.total_size() == 6
    assert alloc.available_size + cache.total_size() == alloc.num_slots
    cache.check_integrity()

    alloc2, pool2 = CheckedAllocator(16), ReqToTokenPool(2, 16)
    off = RadixCache(alloc2, pool2, disable=True)
    req = make_req("off", [1, 2, 3], req_pool=pool2, max_new_tokens=4)
    admit(off, pool2, req)
    compute(alloc2, pool2, req, 3)
    off.cache_unfinished_req(req)
    assert req.prefix_len == 0 and off.total_size() == 0
    off.cache_finished_req(req)
    assert alloc2.available_size == alloc2.num_slots


def test_cache_unfinished_req_chunks_share_and_dedup() -> None:
    alloc, pool = CheckedAllocator(64), ReqToTokenPool(4, 32)
    cache = RadixCache(alloc, pool)
    prompt = list(range(10, 20))
    a = make_req("a", prompt, req_pool=pool, max_new_tokens=4)
    b = make_req("b", prompt + [99], req_pool=pool, max_new_tokens=4)
    admit(cache, pool, a)
    admit(cache, pool, b)
    # Chunk 1 of both, computed in the same batch before either is cached.
    compute(alloc, pool, a, 4)
    b_first = compute(alloc, pool, b, 6)
    cache.cache_unfinished_req(a)
    assert a.prefix_len == 4 and cache.protected_size() == 4
    a_row = pool.table[a.req_pool_idx, :4].clone()
    free_before = alloc.available_size
    cache.cache_unfinished_req(b)
    # b's first 4 slots duplicated a's: freed, and b's row now points at the tree's (a's) slots.
    assert alloc.available_size == free_before + 4
    assert set(b_first[:4].tolist()) <= set(alloc._free.tolist())
    assert pool.table[b.req_pool_idx, :4].tolist() == a_row.tolist()
    assert pool.table[b.req_pool_idx, 4:6].tolist() == b_first[4:].tolist()
    assert b.prefix_len == 6 and b.last_node is cache.match_prefix(prompt[:6]).last_node
    assert cache.protected_size() == 6
    cache.check_integrity()
    # Next chunk of a: 4 -> 10 tokens; tokens 4..5 are b's in the tree now.
    a_second = compute(alloc, pool, a, 6)
    old_node = a.last_node
    cache.cache_unfinished_req(a)
    assert a.last_node is not old_node and a.prefix_len == 10
    assert pool.table[a.req_pool_idx, 4:6].tolist() == b_first[4:].tolist()
    assert set(a_second[:2].tolist()) <= set(alloc._free.tolist())
    assert cache.protected_size() == 10
    cache.check_integrity()
    for r in (a, b):
        cache.cache_finished_req(r)
        pool.free(r.req_pool_idx)
    assert cache.protected_size() == 0
    assert alloc.available_size + cache.total_size() == alloc.num_slots
    assert cache.total_size() == 10
    assert cache.evict(100) == 10 and alloc.available_size == alloc.num_slots
    cache.check_integrity()


def test_bad_calls_raise_clear_errors_and_reset_drops_tree() -> None:
    alloc, pool = CheckedAllocator(16), ReqToTokenPool(2, 8)
    cache = RadixCache(alloc, pool)
    with pytest.raises(ValueError, match="3 tokens but slots has 2"):
        cache.insert([1, 2, 3], slots(1, 2))
    rowless = Req(rid="w", input_ids=[1, 2], sampling_params=SamplingParams())
    with pytest.raises(ValueError, match="'w' has no req_to_token row"):
        cache.cache_finished_req(rowless)
    cache.insert([1, 2, 3], alloc.alloc(3))
    both = alloc.alloc(2)
    alloc.free(both[: cache.insert([1, 4], both)])
    text = cache.pretty_print()
    assert "[1]" in text and "[2, 3]" in text and "[4]" in text and "evictable=4" in text
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.reset()
    assert cache.total_size() == 0 and cache.match_prefix([1, 2, 3]).length == 0
    with pytest.raises(ValueError, match="no longer in the tree"):
        cache.inc_lock_ref(node)
    cache.check_integrity()
