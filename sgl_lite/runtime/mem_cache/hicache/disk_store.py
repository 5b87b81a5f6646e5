"""The disk tier's files: one KV block a file, bounded in bytes, least recently used dropped first.

Layout: `<storage dir>/<fingerprint>/<block key>.kv`. The fingerprint (model_executor/kv_fingerprint.py) names
the weights, dtypes, KV layout and tokenizer, so another model's blocks sit in another folder and are never
listed, let alone loaded. A file is a header line of JSON (format, fingerprint, key, the block's tokens, payload
bytes, CRC-32) and the payload, the block's K and V as raw bytes. It is written to a temporary name and renamed,
so a reader sees a whole file or none; a torn one left by a crash is caught on load (size, CRC) and deleted.

On start the folder is listed (names and sizes only, oldest modification first) so blocks written before a
restart are found; files over the capacity are deleted oldest first. Every I/O error is logged and returned
as a miss (`None` / `False`), never raised: the caller recomputes what it could not load.

Thread safety: the index is guarded by a lock; `read` and `write` run on the tier's I/O threads while the
scheduler asks `present` and `contains`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

FORMAT = "sgl_lite-kv-block-1"
SUFFIX = ".kv"
MAX_HEADER_BYTES = 1 << 16


class DiskKVStore:
    def __init__(self, root: str | Path, fingerprint: str, capacity_bytes: int,
                 fault: Callable[[str], None] | None = None) -> None:
        """`fault(op)`, for tests: called before every read and write ("read" / "write"); an OSError it raises
        is handled as the disk's own would be."""
        self.fingerprint = fingerprint
        self.folder = Path(root) / fingerprint
        self.capacity_bytes = capacity_bytes
        self._fault = fault
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
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
            entries.append((stat.st_mtime_ns, path.stem, stat.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self._bytes += size
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

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def _make_room(self, size: int) -> None:
        """Drop least recently used files until `size` more bytes fit (lock held, or during the scan)."""
        while self._index and self._bytes + size > self.capacity_bytes:
            key, old = self._index.popitem(last=False)
            self._bytes -= old
            (self.folder / f"{key}{SUFFIX}").unlink(missing_ok=True)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        (self.folder / f"{key}{SUFFIX}").unlink(missing_ok=True)

    # ------------------------------------------------------------------ I/O

    def write(self, key: str, tokens: Sequence[int], payload: memoryview) -> bool:
        """Store one block; False (logged) when it does not fit the capacity or the disk fails."""
        header = json.dumps({"format": FORMAT, "fingerprint": self.fingerprint, "key": key, "tokens": list(tokens),
                             "payload_bytes": payload.nbytes, "crc32": zlib.crc32(payload)}).encode() + b"\n"
        size = len(header) + payload.nbytes
        if size > self.capacity_bytes:
            return False
        path = self.folder / f"{key}{SUFFIX}"
        temp = self.folder / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        with self._lock:
            self._make_room(size)
        try:
            if self._fault is not None:
                self._fault("write")
            with open(temp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temp, path)
        except OSError as e:
            temp.unlink(missing_ok=True)
            self._count_error("write", key, e)
            return False
        with self._lock:
            old = self._index.pop(key, None)
            self._bytes += size - (old or 0)
            self._index[key] = size
            self._make_room(0)
        return True

    def read(self, key: str, tokens: Sequence[int], payload_bytes: int) -> bytearray | None:
        """The block's payload, checked against its header, its tokens and its CRC; None (the file deleted
        when it is bad) otherwise."""
        path = self.folder / f"{key}{SUFFIX}"
        try:
            if self._fault is not None:
                self._fault("read")
            with open(path, "rb") as f:
                header = json.loads(f.readline(MAX_HEADER_BYTES))
                problem = self._header_problem(header, key, tokens, payload_bytes)
                if problem is None:
                    payload = bytearray(payload_bytes)
                    got = f.readinto(payload)
                    if got != payload_bytes or f.read(1):
                        problem = f"payload of {got} bytes, expected {payload_bytes}"
                    elif zlib.crc32(payload) != header["crc32"]:
                        problem = "CRC mismatch"
        except (OSError, ValueError) as e:  # ValueError: a header that is not JSON
            self._count_error("read", key, e)
            self._forget(key)
            return None
        if problem is not None:
            logger.warning("hierarchical cache: block %s is unusable (%s); deleted, its tokens recomputed", key, problem)
            self._forget(key)
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
        if header.get("payload_bytes") != payload_bytes or not isinstance(header.get("crc32"), int):
            return f"payload of {header.get('payload_bytes')} bytes where the pool's layout has {payload_bytes}"
        return None

    def _count_error(self, op: str, key: str, error: OSError | ValueError) -> None:
        with self._lock:
            self.io_errors += 1
        logger.warning("hierarchical cache: %s of block %s failed (%s); its tokens are recomputed", op, key, error)
