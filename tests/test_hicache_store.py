"""The disk tier's parts on their own: block keys, the file store (bounds, bad files, restarts, faults), and the
KV copy between pool slots and blocks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sgl_lite.runtime.mem_cache.hicache.block_keys import block_keys
from sgl_lite.runtime.mem_cache.hicache.disk_store import DiskKVStore
from sgl_lite.runtime.mem_cache.hicache.kv_transfer import block_bytes, gather_blocks, scatter_blocks
from sgl_lite.runtime.mem_cache.memory_pool import KVPool

B = 4  # tokens per block in these tests


def test_block_keys_name_whole_prefixes() -> None:
    a = list(range(10))
    keys = block_keys(a, block_tokens=B)
    assert len(keys) == 2  # the partial last block has no key
    b = a[:5] + [99] + a[6:]  # differs in block 1 only
    assert block_keys(b, block_tokens=B)[0] == keys[0] and block_keys(b, block_tokens=B)[1] != keys[1]
    c = [99] + a[1:]  # differs in block 0: every later key differs too (a key names the whole prefix)
    assert all(x != y for x, y in zip(block_keys(c, block_tokens=B), keys))
    assert block_keys(a, 1, block_tokens=B) == keys[:1]
    assert block_keys(a + [1, 2], block_tokens=B) == keys + block_keys(a + [1, 2], block_tokens=B)[2:]
    assert block_keys(a[:8], block_tokens=B) == keys


def payload(n: int, seed: int) -> memoryview:
    return memoryview(bytearray(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed),
                                              dtype=torch.uint8).numpy().tobytes()))


def test_write_read_round_trip_and_restart(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, "fp", 1 << 20)
    data = payload(1000, 0)
    assert store.write("k0", [1, 2, 3, 4], data)
    assert store.read("k0", [1, 2, 3, 4], 1000) == bytes(data)
    assert store.present(["k0", "k1"]) == 1 and store.present(["k1", "k0"]) == 0
    again = DiskKVStore(tmp_path, "fp", 1 << 20)  # a restart lists what the last run wrote
    assert again.contains("k0") and again.bytes_used == store.bytes_used
    assert again.read("k0", [1, 2, 3, 4], 1000) == bytes(data)
    assert not DiskKVStore(tmp_path, "other-model", 1 << 20).contains("k0")  # another fingerprint sees nothing


def test_capacity_drops_least_recently_used(tmp_path: Path) -> None:
    one = DiskKVStore(tmp_path / "probe", "fp", 1 << 20)
    one.write("x", [0], payload(1000, 0))
    size = one.bytes_used + 20  # headers differ by a few bytes (key, CRC digits)
    store = DiskKVStore(tmp_path, "fp", 3 * size)
    for i in range(3):
        assert store.write(f"k{i}", [0], payload(1000, i))
    assert store.read("k0", [0], 1000) is not None  # k0 now most recently used
    assert store.write("k3", [0], payload(1000, 3))
    assert not store.contains("k1") and store.contains("k0") and store.contains("k3")
    assert store.bytes_used <= 3 * size
    assert sorted(p.name for p in store.folder.iterdir()) == ["k0.kv", "k2.kv", "k3.kv"]
    assert not store.write("huge", [0], payload(4 * size, 9))  # larger than the whole tier: refused, nothing lost
    assert store.num_blocks == 3


@pytest.mark.parametrize("damage", ["truncate", "flip", "tokens", "garbage"])
def test_a_bad_file_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    store = DiskKVStore(tmp_path, "fp", 1 << 20)
    store.write("k", [5, 6], payload(500, 1))
    path = store.folder / "k.kv"
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:-10])
    elif damage == "flip":
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    elif damage == "garbage":
        path.write_bytes(b"not a block\n" + raw)
    tokens = [5, 7] if damage == "tokens" else [5, 6]
    assert store.read("k", tokens, 500) is None
    assert not path.exists() and not store.contains("k") and store.bytes_used == 0


def test_a_restart_ignores_torn_writes(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, "fp", 1 << 20)
    (store.folder / "k.123.456.tmp").write_bytes(b"half a block")
    again = DiskKVStore(tmp_path, "fp", 1 << 20)
    assert again.num_blocks == 0 and not any(p.suffix == ".tmp" for p in again.folder.iterdir())


def test_io_faults_are_misses_not_errors(tmp_path: Path) -> None:
    calls: list[str] = []

    def fault(op: str) -> None:
        calls.append(op)
        if len(calls) % 2 == 0:
            raise OSError(28, "No space left on device")

    store = DiskKVStore(tmp_path, "fp", 1 << 20, fault=fault)
    assert store.write("a", [1], payload(100, 0))
    assert not store.write("b", [1], payload(100, 1))  # the second I/O fails: not stored, no stray file
    assert store.read("a", [1], 100) is not None
    assert store.read("a", [1], 100) is None  # the fourth fails: a miss (and the block is forgotten)
    assert store.io_errors == 2
    assert not any(p.name.endswith(".tmp") for p in store.folder.iterdir())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_then_scatter_restores_the_bits(dtype: torch.dtype) -> None:
    pool = KVPool(num_layers=2, num_slots=40, kv_heads=3, head_dim=8, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        k, v = (torch.randn(40, 3, 8, generator=gen) for _ in range(2))
        pool.write(layer, torch.arange(1, 41), k, v)
    src = torch.tensor([3, 9, 1, 20, 33, 2, 8, 4])
    blocks = gather_blocks(pool, src, B)
    assert blocks.shape == (2, 2, 2, B, 3, 8) and blocks[0].numel() * blocks.element_size() == block_bytes(pool, B)
    dst = torch.tensor([30, 31, 32, 34, 35])
    scatter_blocks(pool, list(blocks), 3, dst)  # tokens 3..7 of the two blocks
    for layer in range(2):
        for cache in (pool.k[layer], pool.v[layer]):
            raw = cache.view(torch.uint8) if dtype.itemsize == 1 else cache
            assert torch.equal(raw[dst], raw[src[3:]])


def test_store_files_survive_only_whole(tmp_path: Path) -> None:
    """A write is a rename of a finished temporary file: no reader ever sees half of one."""
    store = DiskKVStore(tmp_path, "fp", 1 << 20)
    store.write("k", [1], payload(2000, 3))
    assert os.listdir(store.folder) == ["k.kv"]


@pytest.mark.parametrize("flags, named", [
    ({"enable_hierarchical_cache": True, "tp_size": 2}, "--tp-size"),
    ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "--disable-radix-cache"),
    ({"hicache_size": -1}, "--hicache-size"),
    ({"hicache_write_policy": "write_around"}, "--hicache-write-policy"),
    ({"hicache_storage_backend": "mooncake"}, "--hicache-storage-backend"),
])
def test_tier_flags_name_what_is_wrong(flags: dict, named: str) -> None:
    from sgl_lite.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match=named):
        ServerArgs(**flags)


def test_a_write_past_the_backlog_keeps_its_leading_blocks(tmp_path: Path) -> None:
    from sgl_lite.runtime.mem_cache.hicache.tier import KVTier

    pool = KVPool(num_layers=1, num_slots=40, kv_heads=1, head_dim=4, dtype=torch.float32)
    pool.write(0, torch.arange(1, 41), torch.randn(40, 1, 4), torch.randn(40, 1, 4))
    store = DiskKVStore(tmp_path, "fp", 1 << 20)
    tier = KVTier(pool, store, block_tokens=B, max_staged_bytes=2 * block_bytes(pool, B))
    tokens = list(range(100, 120))  # five blocks
    try:
        assert tier.write(tokens, torch.arange(1, 21)) == 2
        tier.drain()
        keys = block_keys(tokens, block_tokens=B)
        assert store.present(keys) == 2 and tier.write_dropped_tokens == 3 * B
        assert tier.write(tokens, torch.arange(1, 21)) == 2  # the next two, now that the backlog is written
        tier.drain()
        assert store.present(keys) == 4
    finally:
        tier.close()
