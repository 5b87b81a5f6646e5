"""The disk tier's files: one KV block a file, bounded in bytes, least recently used dropped first.

Layout: `<storage dir>/<fingerprint>/<block key>.kv` for a whole block, `<block key>.<tokens>.<parent key or
root>.kv` for a partial last block (block_keys.py): its name says which block it follows and how many tokens it
holds, so the partial blocks that may continue a prefix are found without reading a file, after a restart too.
The fingerprint (model_executor/kv_fingerprint.py) names the weights, dtypes, KV layout and tokenizer, so another
model's blocks sit in another folder and are never listed, let alone loaded. A file is a header line of JSON (format,
fingerprint, key, the block's tokens, payload bytes, checksum), padded to a multiple of HEADER_ALIGN bytes, and the
payload, the block's K and V as raw bytes. It is written to a temporary name and renamed, so a reader sees a whole
file or none; a torn one left by a crash is caught on load (size, checksum) and deleted. A read copies the payload
into memory of the process's own (a buffer the caller reuses from block to block), not a mapping of the file: a
file truncated by another process while it was mapped would end the whole server with SIGBUS at the next touch
of a page past its new end, where a copy stays whole; a load costs that copy, the checksum's pass and the
pool's copy.

On start the folder is listed (names and sizes only, oldest modification first) so blocks written before a
restart are found; files over the capacity are deleted oldest first. Every I/O error is logged and returned
as a miss (`None` / `False`), never raised: the caller recomputes what it could not load.

Thread safety: the index is guarded by a lock; `read`, `write` and `discard` run on the tier's I/O threads while
the scheduler asks `present`, `contains` and `partials`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

FORMAT = "sgl_lite-kv-block-2"
SUFFIX = ".kv"
MAX_HEADER_BYTES = 1 << 16
HEADER_ALIGN = 64  # the payload starts on a cache line, so its words are read aligned
_WORD_MASK = (1 << 64) - 1
ROOT_NAME = "root"  # a partial first block's parent in its file name (its key is block_keys.ROOT, empty)


def checksum(payload: memoryview) -> int:
    """The payload's little-endian 64-bit words summed modulo 2**64 (a short tail padded with zeros to a word): one
    vectorized pass on the calling thread (numpy: no OpenMP team to fight the forward's for the cores), cheaper
    than a CRC. It catches a flipped bit, a zeroed or foreign page, a shifted payload; unlike a CRC it
    misses words swapped in place, which no disk or torn write produces."""
    whole = len(payload) // 8
    total = int(np.frombuffer(payload, dtype="<u8", count=whole).sum(dtype=np.uint64)) if whole else 0
    return (total + int.from_bytes(bytes(payload[whole * 8 :]), "little")) & _WORD_MASK


@dataclass
class StoredBlock:
    """One file of the index: its bytes and, for a partial block, the key it follows and its token count."""

    size: int
    after: str | None = None  # None: a whole block
    tokens: int = 0

    def file_name(self, key: str) -> str:
        if self.after is None:
            return f"{key}{SUFFIX}"
        return f"{key}.{self.tokens}.{self.after or ROOT_NAME}{SUFFIX}"


def parse_file_name(stem: str, size: int) -> tuple[str, StoredBlock] | None:
    """(key, block) of a block file's name without its suffix; None for a name the store does not write."""
    parts = stem.split(".")
    if len(parts) == 1:
        return stem, StoredBlock(size)
    if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) > 0:
        return parts[0], StoredBlock(size, "" if parts[2] == ROOT_NAME else parts[2], int(parts[1]))
    return None


class DiskKVStore:
    def __init__(self, root: str | Path, fingerprint: str, capacity_bytes: int,
                 fault: Callable[[str, str], None] | None = None) -> None:
        """`fault(op, key)`, for tests: called before every read and write ("read" / "write") of block `key`; an
        OSError it raises is handled as the disk's own would be."""
        self.fingerprint = fingerprint
        self.folder = Path(root) / fingerprint
        self.capacity_bytes = capacity_bytes
        self._fault = fault
        self._lock = threading.Lock()
        self._index: OrderedDict[str, StoredBlock] = OrderedDict()  # least recently used first
        self._partials: dict[str, dict[str, int]] = {}  # parent key -> {partial block key: its tokens}
        self._bytes = 0
        self.io_errors = 0
        self.folder.mkdir(parents=True, exist_ok=True)
        self._scan()

    # ------------------------------------------------------------------ index

    def _scan(self) -> None:
        entries = []
        for path in self.folder.iterdir():
            if path.suffix != SUFFIX:
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)  # a write a crash interrupted
                continue
            try:
                stat = path.stat()
            except OSError:
                continue
            parsed = parse_file_name(path.stem, stat.st_size)
            if parsed is not None:
                entries.append((stat.st_mtime_ns, *parsed))
        for _, key, block in sorted(entries, key=lambda entry: entry[0]):
            self._drop(key)  # one key under two names (not written by this store): the newer one stays
            self._add(key, block)
        self._make_room(0)
        if self._index:
            logger.info("hierarchical cache: %d blocks (%.1f MiB) on disk in %s", len(self._index),
                        self._bytes / 2**20, self.folder)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def present(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are stored (a prefix's blocks are useful only in a row)."""
        with self._lock:
            count = 0
            for key in keys:
                if key not in self._index:
                    break
                count += 1
            return count

    def partials(self, parent: str) -> list[tuple[str, int]]:
        """(key, tokens) of the stored partial blocks that follow the block keyed `parent`."""
        with self._lock:
            return list(self._partials.get(parent, {}).items())

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def _add(self, key: str, block: StoredBlock) -> None:
        """Index a block as the most recently used (lock held, or during the scan)."""
        self._index[key] = block
        self._bytes += block.size
        if block.after is not None:
            self._partials.setdefault(block.after, {})[key] = block.tokens

    def _drop(self, key: str, delete_file: bool = True) -> None:
        """Unindex a block and delete its file (lock held, or during the scan)."""
        block = self._index.pop(key, None)
        if block is None:
            return
        self._bytes -= block.size
        if block.after is not None:
            siblings = self._partials[block.after]
            del siblings[key]
            if not siblings:
                del self._partials[block.after]
        if delete_file:
            (self.folder / block.file_name(key)).unlink(missing_ok=True)

    def _make_room(self, size: int) -> None:
        """Drop least recently used files until `size` more bytes fit (lock held, or during the scan)."""
        while self._index and self._bytes + size > self.capacity_bytes:
            self._drop(next(iter(self._index)))

    def discard(self, key: str) -> None:
        """Delete a block (a partial block a longer write superseded)."""
        with self._lock:
            self._drop(key)

    # ------------------------------------------------------------------ I/O

    def write(self, key: str, tokens: Sequence[int], payload: memoryview, partial_after: str | None = None) -> bool:
        """Store one block (a partial one when `partial_after` names the block it follows); False (logged) when
        it does not fit the capacity or the disk fails."""
        header = json.dumps({"format": FORMAT, "fingerprint": self.fingerprint, "key": key, "tokens": list(tokens),
                             "payload_bytes": payload.nbytes, "checksum": checksum(payload)}).encode()
        header = header.ljust(-(-(len(header) + 1) // HEADER_ALIGN) * HEADER_ALIGN - 1) + b"\n"
        size = len(header) + payload.nbytes
        if size > self.capacity_bytes:
            return False
        block = StoredBlock(size, partial_after, len(tokens) if partial_after is not None else 0)
        path = self.folder / block.file_name(key)
        temp = self.folder / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        with self._lock:
            self._make_room(size)
        try:
            if self._fault is not None:
                self._fault("write", key)
            with open(temp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temp, path)
        except OSError as e:
            temp.unlink(missing_ok=True)
            self._count_error("write", key, e)
            return False
        with self._lock:
            self._drop(key, delete_file=False)  # the same key names the same file: the rename replaced it
            self._add(key, block)
            self._make_room(0)
        return True

    def read(self, key: str, tokens: Sequence[int], payload_bytes: int, into: memoryview | None = None) -> memoryview | None:
        """The block's payload, read into `into` (writable, at least `payload_bytes`: the caller's buffer, which the
        next read into it overwrites) or into a new buffer, checked against its header, its tokens and its
        checksum; None (the file deleted when it is bad) otherwise."""
        if into is not None and (into.readonly or into.nbytes < payload_bytes):
            raise ValueError(f"read: a buffer of {into.nbytes} bytes{' (read-only)' if into.readonly else ''} "
                             f"for a payload of {payload_bytes}")
        with self._lock:
            block = self._index.get(key)
        if block is None:
            return None  # dropped since it was found (capacity, or superseded)
        path = self.folder / block.file_name(key)
        try:
            if self._fault is not None:
                self._fault("read", key)
            with open(path, "rb") as f:
                line = f.readline(MAX_HEADER_BYTES)
                header = json.loads(line)
                problem = self._header_problem(header, key, tokens, payload_bytes)
                if problem is None:
                    got = os.fstat(f.fileno()).st_size - len(line)
                    if got == payload_bytes:  # the size first: a short file costs no read
                        payload = (into if into is not None else memoryview(np.empty(payload_bytes, np.uint8)))[:payload_bytes]
                        got = f.readinto(payload) or 0  # short when the file was cut since its size was taken
                    if got != payload_bytes:
                        problem = f"payload of {got} bytes, expected {payload_bytes}"
                    elif checksum(payload) != header["checksum"]:
                        problem = "checksum mismatch"
        except (OSError, ValueError) as e:  # ValueError: a header that is not JSON
            if isinstance(e, FileNotFoundError) and not self.contains(key):
                return None  # dropped while this read opened it: a miss, not a failing disk
            self._count_error("read", key, e)
            self.discard(key)
            return None
        if problem is not None:
            logger.warning("hierarchical cache: block %s is unusable (%s); deleted, its tokens recomputed", key, problem)
            self.discard(key)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return payload

    def _header_problem(self, header: object, key: str, tokens: Sequence[int], payload_bytes: int) -> str | None:
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            return "not a block file of this format"
        if header.get("fingerprint") != self.fingerprint or header.get("key") != key:
            return "written for another model or block"
        if header.get("tokens") != list(tokens):
            return "its tokens differ from the prefix's"
        if header.get("payload_bytes") != payload_bytes or not isinstance(header.get("checksum"), int):
            return f"payload of {header.get('payload_bytes')} bytes where the pool's layout has {payload_bytes}"
        return None

    def _count_error(self, op: str, key: str, error: OSError | ValueError) -> None:
        with self._lock:
            self.io_errors += 1
        logger.warning("hierarchical cache: %s of block %s failed (%s); its tokens are recomputed", op, key, error)
