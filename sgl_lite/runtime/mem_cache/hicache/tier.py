"""KVTier: what the scheduler asks of the disk tier, with the disk I/O on two threads of its own.

- `write(tokens, slots)`: the blocks of a prefix not yet stored, its partial last block included, are gathered
  from the pool now (the slots may be freed right after) and written by the write thread. Blocks past a backlog
  of `max_write_backlog_bytes` are dropped (counted), the last ones first: the tier falls behind, the scheduler never
  waits for a disk. A block written supersedes the partial blocks at its place whose tokens it starts with:
  they are deleted, so a prefix that grows keeps one partial block on disk, not one per length it had.
- `loadable(tokens, matched)`: the stored blocks that continue a prefix the tree holds `matched` tokens of: its
  whole blocks in a row, then the longest partial block after them whose every token `tokens` has (a partial
  block ends a run: its key names a prefix the request must hold all of).
- `start_load(...)`: the read threads (LOAD_THREADS, taking blocks in turn) read, check and copy the blocks into
  slots the scheduler allocated for them (a `LoadTicket`), so other requests keep decoding meanwhile and the
  copy of one block overlaps the read of the next. A load stops at the first missing or bad block; its
  `loaded_end` is where the blocks before it end.

Counters (`stats`) are the tier's part of the runtime's stats and /metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sgl_lite.runtime.mem_cache.hicache.block_keys import BLOCK_TOKENS, ROOT, block_keys, chain_key
from sgl_lite.runtime.mem_cache.hicache.disk_store import DiskKVStore
from sgl_lite.runtime.mem_cache.hicache.kv_transfer import block_bytes, block_shape, gather_blocks, storage_dtype, write_block
from sgl_lite.runtime.mem_cache.memory_pool import KVPool

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back")
# Threads that read, check and copy a load's blocks: a load is memory traffic (the checksum's pass and the copy),
# which two threads keep going while one waits on the page cache or the GIL.
LOAD_THREADS = 2


@dataclass
class StoredRun:
    """Stored blocks continuing a prefix: tokens [start, end), block-aligned `start`, the last block partial
    when `end` is not aligned. No keys: nothing stored continues the prefix."""

    start: int
    end: int
    keys: list[str]


@dataclass
class LoadTicket:
    """The blocks of a `StoredRun` being read into `slots`: the pool's slots of tokens [first, end), `first` the
    first token the tree does not hold (the run starts on the block boundary before it). Done when every read
    thread has let go of it."""

    start: int
    first: int
    keys: list[str]
    tokens: list[list[int]]  # each block's tokens (checked against the file's header)
    slots: torch.Tensor
    started: float = field(default_factory=time.perf_counter)
    loaded: list[bool] = field(default_factory=list)  # per block: read, checked and in its slots
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    read_seconds: float = 0.0  # the read threads' time reading and checking blocks, summed
    copy_seconds: float = 0.0  # ... and copying them into the pool
    next_block: int = 0  # the next block a read thread takes (under the tier's lock)
    threads_left: int = 0

    @property
    def loaded_end(self) -> int:
        """Where the blocks loaded without a gap from the first end."""
        count = next((i for i, ok in enumerate(self.loaded) if not ok), len(self.loaded))
        return self.start + sum(len(tokens) for tokens in self.tokens[:count])


class KVTier:
    def __init__(self, pool: KVPool, store: DiskKVStore, write_policy: str = "write_through",
                 block_tokens: int = BLOCK_TOKENS, max_write_backlog_bytes: int = 1 << 30) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}; got {write_policy!r}")
        self.pool = pool
        self.store = store
        self.write_policy = write_policy
        self.block_tokens = block_tokens
        self.token_bytes = block_bytes(pool, 1)
        self.block_bytes = self.token_bytes * block_tokens
        self.max_write_backlog_bytes = max(max_write_backlog_bytes, self.block_bytes)
        self._lock = threading.Lock()
        self._writing: set[str] = set()  # keys queued or being written
        self._write_backlog = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sgl-lite-hicache-write")
        self._reader = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="sgl-lite-hicache-read")
        self.spilled_tokens = 0
        self.write_dropped_tokens = 0
        self.loaded_tokens = 0
        self.loads = 0
        self.load_seconds = 0.0
        self.read_seconds = 0.0
        self.copy_seconds = 0.0

    # ------------------------------------------------------------------ writes

    def write(self, tokens: list[int], slots: torch.Tensor, from_pos: int = 0) -> int:
        """Queue the blocks of `tokens` (whose KV is in `slots`), the partial last one included, that end after
        `from_pos` and are not stored yet; return how many."""
        b = self.block_tokens
        keys = block_keys(tokens, block_tokens=b)
        parents = [ROOT, *keys]  # parents[i]: the key block i follows
        tail = len(tokens) - len(keys) * b
        if tail:
            keys.append(chain_key(parents[-1], tokens[-tail:]))
        with self._lock:
            todo = [i for i in range(from_pos // b, len(keys))
                    if keys[i] not in self._writing and not self.store.contains(keys[i])]
            lengths = [min(len(tokens) - i * b, b) for i in todo]
            # The leading blocks first: a block is of use only after every block before it.
            room, kept = max(self.max_write_backlog_bytes - self._write_backlog, 0) // self.token_bytes, 0
            while kept < len(todo) and lengths[kept] <= room:
                room -= lengths[kept]
                kept += 1
            self.write_dropped_tokens += sum(lengths[kept:])
            todo = todo[:kept]
            if not todo:
                return 0
            self._writing.update(keys[i] for i in todo)
            self._write_backlog += sum(lengths[:kept]) * self.token_bytes
        whole = [i for i in todo if (i + 1) * b <= len(tokens)]
        data = list(gather_blocks(self.pool, torch.cat([slots[i * b : (i + 1) * b] for i in whole]), b)) if whole else []
        if len(whole) < len(todo):  # the partial last block, gathered as one block of its own length
            data.extend(gather_blocks(self.pool, slots[len(tokens) - tail : len(tokens)], tail))
        for i, block in zip(todo, data):
            self._writer.submit(self._write_one, keys[i], parents[i], tokens[i * b : (i + 1) * b], block)
        return len(todo)

    def _write_one(self, key: str, parent: str, tokens: list[int], block: torch.Tensor) -> None:
        try:
            partial_after = parent if len(tokens) < self.block_tokens else None
            if self.store.write(key, tokens, memoryview(block.view(torch.uint8).numpy()).cast("B"), partial_after):
                with self._lock:
                    self.spilled_tokens += len(tokens)
                self._supersede(parent, tokens)
        finally:
            with self._lock:
                self._writing.discard(key)
                self._write_backlog -= len(tokens) * self.token_bytes

    def _supersede(self, parent: str, tokens: list[int]) -> None:
        """Delete the partial blocks after `parent` that the block of `tokens`, just stored, starts with: every
        prefix they could serve, this block serves as far or further (write thread)."""
        for key, length in self.store.partials(parent):
            if length < len(tokens) and chain_key(parent, tokens[:length]) == key:
                self.store.discard(key)

    # ------------------------------------------------------------------ loads

    def loadable(self, tokens: list[int], matched: int) -> StoredRun:
        """The stored blocks of `tokens` continuing the `matched` tokens the tree holds (`tokens`: what may come
        from the cache, policy.prefix_match_key); none unless they reach past `matched`."""
        b = self.block_tokens
        first = matched // b
        keys = block_keys(tokens, block_tokens=b)
        run = keys[first:][: self.store.present(keys[first:])]
        after = first + len(run)  # the first block not stored whole: a partial block may stand there
        parent, end = keys[after - 1] if after else ROOT, after * b
        tail: tuple[int, str] | None = None  # (tokens, key) of the longest partial block the request covers
        for key, length in self.store.partials(parent):
            if length <= len(tokens) - end and (tail is None or length > tail[0]) \
                    and chain_key(parent, tokens[end : end + length]) == key:
                tail = (length, key)
        if tail is not None and end + tail[0] > matched:
            run.append(tail[1])
            end += tail[0]
        return StoredRun(first * b, end, run)

    def start_load(self, tokens: list[int], run: StoredRun, first: int, slots: torch.Tensor) -> LoadTicket:
        """Read `run` of `tokens` into `slots`, the slots of tokens [first, run.end)."""
        b = self.block_tokens
        if not run.start <= first < run.end or slots.numel() != run.end - first:
            raise ValueError(f"start_load: {slots.numel()} slots for tokens [{first}, {run.end}) of a run from {run.start}")
        ticket = LoadTicket(run.start, first, run.keys, [tokens[i : min(i + b, run.end)] for i in range(run.start, run.end, b)],
                            slots, loaded=[False] * len(run.keys), threads_left=LOAD_THREADS)
        for _ in range(LOAD_THREADS):
            self._reader.submit(self._read, ticket)
        return ticket

    def _read(self, ticket: LoadTicket) -> None:
        """One read thread's part of a load: blocks in turn until none is left, the load is cancelled or a block
        fails (the blocks after it would be of no use)."""
        dtype, read_seconds, copy_seconds = storage_dtype(self.pool), 0.0, 0.0
        # one block's bytes, read into again for each block once the last one is in the pool
        buffer = memoryview(np.empty(self.block_tokens * self.token_bytes, np.uint8))
        try:
            while True:
                with self._lock:
                    i = ticket.next_block
                    ticket.next_block += 1
                if i >= len(ticket.keys) or ticket.cancelled:
                    break
                started = time.perf_counter()
                tokens = ticket.tokens[i]
                payload = self.store.read(ticket.keys[i], tokens, len(tokens) * self.token_bytes, into=buffer)
                read_seconds += time.perf_counter() - started
                if payload is None:
                    self._stop_reading(ticket)
                    break
                started = time.perf_counter()
                block = torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(block_shape(self.pool, len(tokens)))
                begin = ticket.start + i * self.block_tokens  # the block's first token
                skip = max(ticket.first - begin, 0)
                write_block(self.pool, block, skip, ticket.slots[begin + skip - ticket.first : begin + len(tokens) - ticket.first])
                ticket.loaded[i] = True
                copy_seconds += time.perf_counter() - started
        except Exception:  # never leave a ticket undone: the scheduler would wait for it forever
            logger.exception("hierarchical cache: a load failed; its tokens are recomputed")
            self._stop_reading(ticket)
        finally:
            with self._lock:
                ticket.read_seconds += read_seconds
                ticket.copy_seconds += copy_seconds
                ticket.threads_left -= 1
                if ticket.threads_left == 0:
                    ticket.done.set()

    def _stop_reading(self, ticket: LoadTicket) -> None:
        """The other read threads take no more of `ticket`'s blocks."""
        with self._lock:
            ticket.next_block = len(ticket.keys)

    def finish_load(self, ticket: LoadTicket, installed_tokens: int) -> None:
        """The scheduler is done with `ticket` (installed, dropped or cancelled): count it."""
        with self._lock:
            if installed_tokens:
                self.loads += 1
                self.loaded_tokens += installed_tokens
                self.load_seconds += time.perf_counter() - ticket.started
                self.read_seconds += ticket.read_seconds
                self.copy_seconds += ticket.copy_seconds

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
            "hicache_load_read_seconds_total": self.read_seconds,
            "hicache_load_copy_seconds_total": self.copy_seconds,
            "hicache_io_errors_total": self.store.io_errors,
        }
