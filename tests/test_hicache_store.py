"""The disk tier's parts on their own: block keys, the file store (bounds, bad files, restarts, faults), and the
KV copy between pool slots and blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_lite.runtime.kernels.loader import load_cpu_ops
from sgl_lite.runtime.mem_cache.hicache.block_keys import ROOT, block_keys, chain_key
from sgl_lite.runtime.mem_cache.hicache.disk_store import HEADER_ALIGN, DiskKVStore, checksum
from sgl_lite.runtime.mem_cache.hicache.kv_transfer import block_bytes, gather_blocks, write_block
from sgl_lite.runtime.mem_cache.hicache.tier import KVTier
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
    # A partial last block chains like a whole one: its key names the whole prefix it ends.
    assert chain_key(ROOT, a[:4]) == keys[0] and chain_key(keys[0], a[4:8]) == keys[1]
    tail = chain_key(keys[1], a[8:])
    assert tail not in keys and tail != chain_key(keys[1], a[8:9]) and tail != chain_key(block_keys(b, block_tokens=B)[1], a[8:])


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


@pytest.mark.parametrize("damage", ["truncate", "flip", "flip_word", "zeroed", "tokens", "garbage"])
def test_a_bad_file_is_a_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    store = DiskKVStore(tmp_path, "fp", 1 << 20)
    store.write("k", [5, 6], payload(500, 1))
    path = store.folder / "k.kv"
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:-10])
    elif damage == "flip":  # in the payload's tail, past its last whole 64-bit word
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    elif damage == "flip_word":
        path.write_bytes(raw[:-250] + bytes([raw[-250] ^ 0x80]) + raw[-249:])
    elif damage == "zeroed":
        path.write_bytes(raw[:-300] + bytes(64) + raw[-236:])
    elif damage == "garbage":
        path.write_bytes(b"not a block\n" + raw)
    tokens = [5, 7] if damage == "tokens" else [5, 6]
    assert store.read("k", tokens, 500) is None
    assert not path.exists() and not store.contains("k") and store.bytes_used == 0


def test_a_read_gives_the_payload_aligned_and_writable(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, "fp", 1 << 20)
    data = payload(4096 + 3, 2)
    store.write("k", [5, 6], data)
    raw = (store.folder / "k.kv").read_bytes()
    assert raw.index(b"\n") + 1 == len(raw) - len(data) and (len(raw) - len(data)) % HEADER_ALIGN == 0
    got = store.read("k", [5, 6], len(data))
    assert got is not None and not got.readonly and bytes(got) == bytes(data)
    assert checksum(got) == checksum(data) != checksum(payload(4096 + 3, 3))
    buffer = memoryview(bytearray(2 * len(data)))  # the caller's buffer: the payload lands at its start
    got = store.read("k", [5, 6], len(data), into=buffer)
    assert got is not None and bytes(got) == bytes(data) == bytes(buffer[: len(data)])
    with pytest.raises(ValueError, match="buffer of 10 bytes"):
        store.read("k", [5, 6], len(data), into=memoryview(bytearray(10)))
    assert store.contains("k")  # a caller's mistake, not the file's: the block stays


# Read a block, cut its file short as another process might, then touch every byte of what the read gave.
TRUNCATED_AFTER_READ = """
import os, sys
from sgl_lite.runtime.mem_cache.hicache.disk_store import DiskKVStore
store = DiskKVStore(sys.argv[1], "fp", 1 << 30)
data = memoryview(os.urandom(1 << 20))
store.write("k", [1, 2], data)
got = store.read("k", [1, 2], data.nbytes)
os.truncate(store.folder / "k.kv", 100)
assert bytes(got) == bytes(data)
print("intact")
"""


def test_a_file_cut_short_after_its_read_leaves_the_payload_whole(tmp_path: Path) -> None:
    # A payload mapped from the file would end the process with SIGBUS here (pages past the new end).
    done = subprocess.run([sys.executable, "-c", TRUNCATED_AFTER_READ, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "intact", (done.returncode, done.stderr[-2000:])


def test_a_restart_ignores_torn_writes(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, "fp", 1 << 20)
    (store.folder / "k.123.456.tmp").write_bytes(b"half a block")
    again = DiskKVStore(tmp_path, "fp", 1 << 20)
    assert again.num_blocks == 0 and not any(p.suffix == ".tmp" for p in again.folder.iterdir())


def test_io_faults_are_misses_not_errors(tmp_path: Path) -> None:
    calls: list[str] = []

    def fault(op: str, key: str) -> None:
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


def random_pool(dtype: torch.dtype, num_layers: int = 2, kv_heads: int = 3, head_dim: int = 8) -> KVPool:
    pool = KVPool(num_layers=num_layers, num_slots=40, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for layer in range(num_layers):
        k, v = (torch.randn(40, kv_heads, head_dim, generator=gen) for _ in range(2))
        pool.write(layer, torch.arange(1, 41), k, v)
    return pool


def pool_bits(pool: KVPool) -> list[torch.Tensor]:
    """Every layer's K and V as stored (fp8 as its bytes: float8 has no equality kernel), copied."""
    return [(c.view(torch.uint8) if c.element_size() == 1 else c).clone() for layer in range(pool.num_layers)
            for c in (pool.k[layer], pool.v[layer])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("dst", [[30, 31, 32, 34, 35, 36, 37, 38], [30, 31, 32, 33, 34, 35, 36, 37]],
                         ids=["runs_and_gaps", "one_run"])
@pytest.mark.parametrize("copy", ["op", "numpy"])
def test_gather_then_write_restores_the_bits(dtype: torch.dtype, dst: list[int], copy: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_lite.runtime.mem_cache.hicache import kv_transfer

    if copy == "op" and not (load_cpu_ops() and kv_transfer.has_write_kv_rows()):
        pytest.skip("the C++ ops are not built here")
    if copy == "numpy":  # where the C++ op is not built or not loaded
        monkeypatch.setattr(kv_transfer, "has_write_kv_rows", lambda: False)
    pool = random_pool(dtype)
    src = torch.tensor([3, 9, 1, 20, 33, 2, 8, 4, 17, 11, 12])  # two whole blocks and a partial one of 3 tokens
    blocks = gather_blocks(pool, src[:8], B)
    assert blocks.shape == (2, 2, 2, B, 3, 8) and blocks[0].numel() * blocks.element_size() == block_bytes(pool, B)
    tail = gather_blocks(pool, src[8:], 3)[0]
    assert tail.shape == (2, 2, 3, 3, 8)
    before = pool_bits(pool)
    dst = torch.tensor(dst)
    write_block(pool, blocks[0], 3, dst[:1])  # tokens 3..10: the end of block 0, block 1, the partial block
    write_block(pool, blocks[1], 0, dst[1:5])
    write_block(pool, tail, 0, dst[5:])
    after = pool_bits(pool)
    others = torch.ones(41, dtype=torch.bool)
    others[dst] = False
    for old, new in zip(before, after):
        assert torch.equal(new[dst], old[src[3:]])  # each token's K and V bit for bit, in its slot
        assert torch.equal(new[others], old[others])  # and nothing else written
    with pytest.raises(ValueError, match="outside"):
        write_block(pool, tail, 1, dst[5:])  # 3 slots past token 1 run off the block's 3 tokens


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
    tier = KVTier(pool, store, block_tokens=B, max_write_backlog_bytes=2 * block_bytes(pool, B))
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


def small_tier(tmp_path: Path, pool: KVPool) -> KVTier:
    return KVTier(pool, DiskKVStore(tmp_path, "fp", 1 << 20), block_tokens=B)


def stored_files(tier: KVTier) -> list[Path]:
    return sorted(tier.store.folder.iterdir())


def test_a_partial_last_block_is_stored_and_serves_only_requests_holding_all_its_tokens(tmp_path: Path) -> None:
    pool = random_pool(torch.float32)
    tier = small_tier(tmp_path, pool)
    tokens = list(range(100, 130))
    try:
        assert tier.write(tokens[:10], torch.arange(1, 11)) == 3  # two whole blocks and a partial one of 2 tokens
        tier.drain()
        assert len(stored_files(tier)) == 3 and tier.spilled_tokens == 10
        covering = tier.loadable(tokens[:12], 0)  # holds all 10 tokens, and more
        assert (covering.start, covering.end, len(covering.keys)) == (0, 10, 3)
        assert tier.loadable(tokens[:9], 0).end == 8  # holds only one of the partial block's two tokens
        assert tier.loadable(tokens[:8] + [7, 7, 7], 0).end == 8  # its 9th token differs
        assert tier.loadable(tokens[:12], 8).keys == [covering.keys[-1]]  # the tree holds the whole blocks
        assert tier.loadable(tokens[:12], 10).keys == []  # ... and the partial block's tokens: nothing to load
        restarted = small_tier(tmp_path, pool)  # the partial block's file name says where it belongs
        try:
            assert restarted.loadable(tokens[:12], 0) == covering
        finally:
            restarted.close()
    finally:
        tier.close()


def test_a_longer_write_supersedes_the_partial_blocks_it_starts_with(tmp_path: Path) -> None:
    pool = random_pool(torch.float32)
    tier = small_tier(tmp_path, pool)
    tokens = list(range(100, 130))
    try:
        tier.write(tokens[:10], torch.arange(1, 11))  # partial block [8, 10)
        tier.write(tokens[:8] + [5, 6, 7], torch.arange(11, 22))  # another one at [8, 11): it diverges, both stay
        tier.drain()
        assert len(tier.store.partials(block_keys(tokens, block_tokens=B)[1])) == 2
        tier.write(tokens[:11], torch.arange(1, 12))  # [8, 11) of the same tokens: replaces [8, 10)
        tier.drain()
        tier.write(tokens[:14], torch.arange(1, 15))  # the whole block [8, 12) replaces [8, 11); [12, 14) is new
        tier.drain()
        keys = block_keys(tokens[:14], block_tokens=B)
        assert [length for _, length in tier.store.partials(keys[1])] == [3]  # only the diverging one is left
        assert [length for _, length in tier.store.partials(keys[2])] == [2]
        files = stored_files(tier)
        assert len(files) == tier.store.num_blocks == 5  # three whole blocks, two partial ones
        assert sum(f.stat().st_size for f in files) == tier.store.bytes_used
        assert tier.loadable(tokens[:20], 0).end == 14
        assert tier.loadable(tokens[:8] + [5, 6, 7, 1], 0).end == 11
        again = DiskKVStore(tmp_path, "fp", 1 << 20)  # a restart counts the same files and bytes
        assert (again.num_blocks, again.bytes_used) == (5, tier.store.bytes_used)
    finally:
        tier.close()


def test_a_loaded_run_with_its_partial_block_restores_the_bits_and_a_failed_read_ends_it(tmp_path: Path) -> None:
    pool = random_pool(torch.bfloat16)
    tier = small_tier(tmp_path, pool)
    tokens = list(range(100, 130))
    src = torch.tensor([5, 9, 2, 30, 31, 7, 1, 3, 22, 23])
    try:
        tier.write(tokens[:10], src)
        tier.drain()
        before = pool_bits(pool)
        partial_key = tier.loadable(tokens[:12], 0).keys[2]

        def partial_read_fails(op: str, key: str) -> None:
            if op == "read" and key == partial_key:
                raise OSError(5, "Input/output error")

        for fail_partial in (False, True):
            if fail_partial:  # the partial block's read fails: the run ends after the whole blocks
                tier.store._fault = partial_read_fails
            run = tier.loadable(tokens[:12], 0)
            dst = torch.arange(11, 11 + run.end - 1)  # the tree holds token 0: the load writes tokens 1.. into dst
            ticket = tier.start_load(tokens[:12], run, 1, dst)
            assert ticket.done.wait(10)
            end = ticket.loaded_end
            assert end == (8 if fail_partial else 10)
            tier.finish_load(ticket, end - 1)
            for old, new in zip(before, pool_bits(pool)):
                assert torch.equal(new[dst[: end - 1]], old[src[1:end]])
        assert tier.store.io_errors == 1 and tier.loadable(tokens[:12], 0).end == 8  # the failed block is a miss
    finally:
        tier.close()


def test_a_partial_block_dropped_before_its_read_is_a_miss_not_an_error(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, "fp", 1 << 20)
    store.write("k", [1, 2], payload(100, 0), partial_after=ROOT)
    assert [p.name for p in store.folder.iterdir()] == ["k.2.root.kv"] and store.partials(ROOT) == [("k", 2)]
    store.discard("k")
    assert store.read("k", [1, 2], 100) is None and store.io_errors == 0
    assert store.partials(ROOT) == [] and store.bytes_used == 0 and not any(store.folder.iterdir())
