"""KVTier: what the scheduler asks of the disk tier, with the disk I/O on two threads of its own.

- `write(tokens, slots)`: the whole blocks of a prefix not yet stored are gathered from the pool now (the slots
  may be freed right after) and written by the write thread. Blocks past a backlog of `max_staged_bytes` are
  dropped (counted), the last ones first: the tier falls behind, the scheduler never waits for a disk.
- `loadable(tokens, matched)`: the stored blocks that continue a prefix the tree holds `matched` tokens of.
- `start_load(...)`: the read thread reads them into memory (a `LoadTicket`); the scheduler copies them into
  the pool (`scatter_blocks`) when the ticket is done, so other requests keep decoding meanwhile. A read stops
  at the first missing or bad block; the ticket then holds the blocks before it.

Counters (`stats`) are the tier's part of the runtime's stats and /metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_lite.runtime.mem_cache.hicache.block_keys import BLOCK_TOKENS, block_keys
from sgl_lite.runtime.mem_cache.hicache.disk_store import DiskKVStore
from sgl_lite.runtime.mem_cache.hicache.kv_transfer import block_bytes, block_shape, gather_blocks, storage_dtype
from sgl_lite.runtime.mem_cache.memory_pool import KVPool

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back")


@dataclass
class LoadTicket:
    """Blocks [first_block, first_block + len(keys)) of a prefix being read; `blocks` is set when `done`."""

    first_block: int
    keys: list[str]
    tokens: list[list[int]]  # each block's tokens (checked against the file's header)
    nbytes: int
    started: float = field(default_factory=time.perf_counter)
    blocks: list[torch.Tensor] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False


class KVTier:
    def __init__(self, pool: KVPool, store: DiskKVStore, write_policy: str = "write_through",
                 block_tokens: int = BLOCK_TOKENS, max_staged_bytes: int = 1 << 30) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}; got {write_policy!r}")
        self.pool = pool
        self.store = store
        self.write_policy = write_policy
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes(pool, block_tokens)
        self.max_staged_bytes = max(max_staged_bytes, self.block_bytes)
        self._lock = threading.Lock()
        self._writing: set[str] = set()  # keys queued or being written
        self._write_backlog = 0
        self._staged = 0  # bytes of loads started and not yet consumed
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sgl-lite-hicache-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="sgl-lite-hicache-read")
        self.spilled_tokens = 0
        self.write_dropped_tokens = 0
        self.loaded_tokens = 0
        self.loads = 0
        self.load_seconds = 0.0

    # ------------------------------------------------------------------ writes

    def write(self, tokens: list[int], slots: torch.Tensor, from_pos: int = 0) -> int:
        """Queue the whole blocks of `tokens` (whose KV is in `slots`) that end after `from_pos` and are not
        stored yet; return how many."""
        keys = block_keys(tokens, block_tokens=self.block_tokens)
        first = from_pos // self.block_tokens
        with self._lock:
            todo = [i for i in range(first, len(keys)) if keys[i] not in self._writing and not self.store.contains(keys[i])]
            # The leading blocks first: a block is of use only after every block before it.
            room = max(self.max_staged_bytes - self._write_backlog, 0) // self.block_bytes
            self.write_dropped_tokens += max(len(todo) - room, 0) * self.block_tokens
            todo = todo[:room]
            if not todo:
                return 0
            self._writing.update(keys[i] for i in todo)
            self._write_backlog += len(todo) * self.block_bytes
        b = self.block_tokens
        index = torch.cat([slots[i * b : (i + 1) * b] for i in todo])
        data = gather_blocks(self.pool, index, b)
        for j, i in enumerate(todo):
            self._writer.submit(self._write_one, keys[i], tokens[i * b : (i + 1) * b], data[j])
        return len(todo)

    def _write_one(self, key: str, tokens: list[int], block: torch.Tensor) -> None:
        try:
            if self.store.write(key, tokens, memoryview(block.view(torch.uint8).numpy()).cast("B")):
                with self._lock:
                    self.spilled_tokens += len(tokens)
        finally:
            with self._lock:
                self._writing.discard(key)
                self._write_backlog -= self.block_bytes

    # ------------------------------------------------------------------ loads

    def loadable(self, tokens: list[int], matched: int) -> tuple[int, list[str]]:
        """(first block, keys) of the stored whole blocks of `tokens` continuing the `matched` tokens the tree
        holds (`tokens`: what may come from the cache, policy.prefix_match_key)."""
        first = matched // self.block_tokens
        limit = len(tokens) // self.block_tokens
        if first >= limit:
            return first, []
        keys = block_keys(tokens, limit, self.block_tokens)[first:]
        return first, keys[: self.store.present(keys)]

    def can_stage(self, num_blocks: int) -> bool:
        with self._lock:
            return self._staged == 0 or self._staged + num_blocks * self.block_bytes <= self.max_staged_bytes

    def start_load(self, tokens: list[int], first_block: int, keys: list[str]) -> LoadTicket:
        b = self.block_tokens
        ticket = LoadTicket(first_block, keys, [tokens[(first_block + j) * b : (first_block + j + 1) * b] for j in range(len(keys))],
                            len(keys) * self.block_bytes)
        with self._lock:
            self._staged += ticket.nbytes
        self._reader.submit(self._read, ticket)
        return ticket

    def _read(self, ticket: LoadTicket) -> None:
        try:
            shape, dtype = block_shape(self.pool, self.block_tokens), storage_dtype(self.pool)
            for key, tokens in zip(ticket.keys, ticket.tokens):
                if ticket.cancelled:
                    break
                payload = self.store.read(key, tokens, self.block_bytes)
                if payload is None:
                    break
                ticket.blocks.append(torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(shape))
        except Exception:  # never leave a ticket undone: the scheduler would wait for it forever
            logger.exception("hierarchical cache: a load failed; its tokens are recomputed")
        finally:
            ticket.done.set()

    def finish_load(self, ticket: LoadTicket, installed_tokens: int) -> None:
        """The scheduler is done with `ticket` (installed, dropped or cancelled): release its staging."""
        with self._lock:
            self._staged -= ticket.nbytes
            if installed_tokens:
                self.loads += 1
                self.loaded_tokens += installed_tokens
                self.load_seconds += time.perf_counter() - ticket.started
        ticket.blocks = []

    # ------------------------------------------------------------------ lifetime and stats

    def drain(self) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)

    def stats(self) -> dict[str, Any]:
        return {
            "hicache_disk_blocks": self.store.num_blocks,
            "hicache_disk_bytes": self.store.bytes_used,
            "hicache_spilled_tokens_total": self.spilled_tokens,
            "hicache_write_dropped_tokens_total": self.write_dropped_tokens,
            "hicache_loaded_tokens_total": self.loaded_tokens,
            "hicache_loads_total": self.loads,
            "hicache_load_seconds_total": self.load_seconds,
            "hicache_io_errors_total": self.store.io_errors,
        }
