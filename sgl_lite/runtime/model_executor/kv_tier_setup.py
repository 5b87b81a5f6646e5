"""The disk tier of a served model (`--enable-hierarchical-cache`): its folder, its size, and the fingerprint that
keeps one model's KV from ever being loaded into another.

The fingerprint hashes what the KV's bits depend on: the model's config, the weights (each weight file's name,
size and 16 samples of 64 KiB spread through it, so two checkpoints of one architecture differ), the tokenizer's
files, the compute and KV dtypes, the quantization, the pool's layout and the block size. A restart of the same
model with the same flags finds its blocks again; anything else writes to a folder of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from sgl_lite.runtime.mem_cache.hicache.block_keys import BLOCK_TOKENS
from sgl_lite.runtime.mem_cache.hicache.disk_store import DiskKVStore
from sgl_lite.runtime.mem_cache.hicache.tier import KVTier
from sgl_lite.runtime.model_executor.fault_injection import disk_fault_hook
from sgl_lite.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 64 << 10
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model")
MAX_DEFAULT_GIB = 64.0


def default_storage_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "sgl_lite" / "hicache"


def file_digest(path: Path) -> str:
    """Name, size and evenly spread samples of one file (weights are GBs: hashing them whole costs seconds)."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        for i in range(SAMPLES_PER_FILE):
            f.seek(max(size - SAMPLE_BYTES, 0) * i // max(SAMPLES_PER_FILE - 1, 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def kv_fingerprint(model_dir: Path, tokenizer_dir: Path, layout: dict[str, Any]) -> str:
    """A hex name for everything the stored KV depends on (see the module docstring)."""
    parts: dict[str, Any] = {"layout": layout, "block_tokens": BLOCK_TOKENS}
    config = model_dir / "config.json"
    parts["config"] = config.read_text() if config.exists() else None
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    parts["weights"] = [file_digest(p) for p in weights]
    parts["tokenizer"] = [file_digest(tokenizer_dir / name) for name in TOKENIZER_FILES if (tokenizer_dir / name).exists()]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def make_kv_tier(args: ServerArgs, runner: Any) -> KVTier | None:
    """The tier over `runner.kv_pool` when --enable-hierarchical-cache is on, else None."""
    if not args.enable_hierarchical_cache:
        return None
    root = Path(args.hicache_storage_dir) if args.hicache_storage_dir else default_storage_dir()
    root.mkdir(parents=True, exist_ok=True)
    capacity_gib = args.hicache_size or min(shutil.disk_usage(root).free / 2**30 / 2, MAX_DEFAULT_GIB)
    layout = {**runner.kv_cache_summary(), "dtype": str(runner.dtype), "kv_dtype": str(runner.kv_dtype),
              "quantization": args.quantization}
    layout.pop("slots", None)
    layout.pop("bytes", None)
    tokenizer_dir = Path(args.tokenizer_path) if args.tokenizer_path else runner.model_dir
    fingerprint = kv_fingerprint(runner.model_dir, tokenizer_dir, layout)
    store = DiskKVStore(root, fingerprint, int(capacity_gib * 2**30), fault=disk_fault_hook())
    (store.folder / "model.json").write_text(json.dumps({"model": str(runner.model_dir), **layout}, indent=1))
    # Writes queued may hold this much memory: a quarter of the pool, at least 1 GiB (a few contexts of a 1-2B
    # model, whose KV is about 0.2 MiB a token).
    backlog = max(runner.kv_pool.total_bytes // 4, 1 << 30)
    tier = KVTier(runner.kv_pool, store, args.hicache_write_policy, max_write_backlog_bytes=backlog)
    logger.info("hierarchical cache: %s, %.1f GiB in %s (%d blocks found), %d-token blocks of %.2f MiB",
                args.hicache_write_policy, capacity_gib, store.folder, store.num_blocks, BLOCK_TOKENS,
                tier.block_bytes / 2**20)
    return tier
