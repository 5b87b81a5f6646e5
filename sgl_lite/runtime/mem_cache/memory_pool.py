"""KV memory with page size 1: the slot pool, its allocator, and the request-to-slot table.

- `KVPool`: per layer one K and one V tensor of shape [num_slots + 1, kv_heads, head_dim]. Slot 0 is
  reserved as a padding target and never handed out, so `num_slots` usable slots are 1..num_slots.
  Only slot 0 is initialized (to zeros); the others hold garbage until written.
- `SlotAllocator`: the free list. `alloc(n)` returns n slot indices or None (never a partial
  allocation); `free(slots)` returns them.
- `ReqToTokenPool`: a table [max_requests, max_context] of slot indices; row i holds request i's
  slots in token order. Rows are handed out with `alloc()` and returned with `free(row)`.
"""

from __future__ import annotations

import torch


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
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(self._free.device, torch.int64)))


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
        self.k[layer][slots] = k
        self.v[layer][slots] = v


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
