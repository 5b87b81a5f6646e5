"""KV memory with page size 1: the slot pool, its allocator, and the request-to-slot table.

- `KVPool`: per layer one K and one V tensor of shape [num_slots + 1, kv_heads, head_dim]. Slot 0 is
  reserved as a padding target and never handed out, so `num_slots` usable slots are 1..num_slots.
  Only slot 0 is initialized (to zeros); the others hold garbage until written. The pool's dtype is the
  model's, or an 8-bit float (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`, scale 1.0 as SGLang's default):
  values are rounded to it on write, saturated at its largest finite value, and readers convert back.
- `SlotAllocator`: the free list. `alloc(n)` returns n slot indices or None (never a partial
  allocation); `free(slots)` returns them, to be handed out first (last freed, first reused).
- `ReqToTokenPool`: a table [max_requests, max_context] of slot indices; row i holds request i's
  slots in token order. Rows are handed out with `alloc()` and returned with `free(row)`.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype values (SGLang's names) that store the pool in 8 bits; "auto" keeps the model's dtype.
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of auto, {', '.join(FP8_KV_DTYPES)}; got {name!r}")
    return FP8_KV_DTYPES[name]


class SlotAllocator:
    def __init__(self, num_slots: int, device: str | torch.device = "cpu") -> None:
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        # Slot 0 is the padding slot; usable slots are 1..num_slots.
        self._free = torch.arange(1, self.num_slots + 1, dtype=torch.int64, device=self.device)

    @property
    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        # Freed slots go to the front: the next allocation reuses them (LIFO), so serving keeps touching
        # the same few pages of the pool. A FIFO list walked through every never-written page first, and
        # each first write to a page of the (uninitialized) pool is a page fault, which makes a fresh
        # server's K/V stores several times slower than on warm pages (docs/performance.md, "Model path").
        if slots.numel():
            self._free = torch.cat((slots.to(self._free.device, torch.int64), self._free))


_FP8 = tuple(FP8_KV_DTYPES.values())


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_slots + 1, kv_heads, head_dim)
        # Uninitialized: zero-filling gigabytes costs seconds per start and commits every page up front.
        # Every slot is written before it is read, except padding slot 0, which attention reads with
        # probability 0 and must therefore hold finite values (0 * NaN would poison the output).
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for tensor in (*self.k, *self.v):
            tensor[0].zero_()

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_slot(self.num_layers, self.kv_heads, self.head_dim, self.dtype) * (self.num_slots + 1)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k, v [n, kv_heads, head_dim] at `slots` (int64 [n]) of layer `layer`."""
        for cache, x in ((self.k[layer], k), (self.v[layer], v)):
            if self.dtype in _FP8:
                # Saturate: e5m2 would turn an out-of-range value into inf, and inf * 0 poisons attention.
                finite = torch.finfo(self.dtype).max
                x = x.clamp(-finite, finite).to(self.dtype).view(torch.uint8)
                cache = cache.view(torch.uint8)  # index_copy_ has no float8 kernel; the bytes are the same
            # index_copy_ is the plain row scatter (index_put_ with a tensor index takes a slower general path)
            cache.index_copy_(0, slots, x.to(cache.dtype))


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context: int, device: str | torch.device = "cpu") -> None:
        self.max_requests = max_requests
        self.max_context = max_context
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_requests))

    @property
    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def clear(self) -> None:
        self._free_rows = list(range(self.max_requests))
