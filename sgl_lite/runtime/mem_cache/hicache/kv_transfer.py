"""KV between the pool's slots and the tier's blocks: a block is one tensor [layers, 2 (K, V), tokens, heads, dim].

Blocks keep the pool's bytes exactly (an fp8 pool's as uint8), so a block written and read back restores the
same bits in whatever slots it lands in. Gathers return CPU tensors (what the disk takes); scatters accept
them and move them to the pool's device.
"""

from __future__ import annotations

import torch

from sgl_lite.runtime.mem_cache.memory_pool import KVPool


def storage_view(tensor: torch.Tensor) -> torch.Tensor:
    """The pool tensor as the tier stores it: fp8 as its bytes (index_copy_ has no float8 kernel)."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.is_floating_point() else tensor


def block_shape(pool: KVPool, block_tokens: int) -> tuple[int, ...]:
    return (pool.num_layers, 2, block_tokens, pool.kv_heads, pool.head_dim)


def block_bytes(pool: KVPool, block_tokens: int) -> int:
    return KVPool.bytes_per_slot(pool.num_layers, pool.kv_heads, pool.head_dim, pool.dtype) * block_tokens


def storage_dtype(pool: KVPool) -> torch.dtype:
    return storage_view(pool.k[0]).dtype


def gather_blocks(pool: KVPool, slots: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """The KV of `slots` (a whole number of blocks, in token order) as a CPU tensor [blocks, *block_shape]; a
    partial block is gathered alone, as one block of its own length."""
    if slots.numel() % block_tokens:
        raise ValueError(f"gather_blocks: {slots.numel()} slots are not a whole number of {block_tokens}-token blocks")
    num_blocks = slots.numel() // block_tokens
    out = torch.empty((num_blocks, *block_shape(pool, block_tokens)), dtype=storage_dtype(pool))
    index = slots.to(pool.k[0].device)
    for layer in range(pool.num_layers):
        for side, cache in enumerate((pool.k[layer], pool.v[layer])):
            rows = storage_view(cache).index_select(0, index)
            out[:, layer, side] = rows.view(num_blocks, block_tokens, pool.kv_heads, pool.head_dim).cpu()
    return out


def scatter_blocks(pool: KVPool, blocks: list[torch.Tensor], skip: int, slots: torch.Tensor) -> None:
    """Write tokens [skip, skip + len(slots)) of the concatenated `blocks` (each [layers, 2, tokens, heads, dim],
    the last one possibly a partial block) into `slots` of every layer. Each block is copied straight from its
    own memory into its slots, a layer and a side at a time: the load is never stacked or permuted first."""
    total = sum(block.shape[2] for block in blocks)
    if skip < 0 or skip + slots.numel() > total:
        raise ValueError(f"scatter_blocks: tokens [{skip}, {skip + slots.numel()}) outside the blocks' {total}")
    device = pool.k[0].device
    index, host_slots = slots.to(device), slots.cpu()  # host_slots: the runs are found without a device sync
    start, written = 0, 0  # where this block starts among the blocks' tokens; slots filled so far
    for block in blocks:
        first, end = max(skip - start, 0), min(skip + slots.numel() - start, block.shape[2])
        if first < end:
            run = consecutive_start(host_slots[written : written + end - first])
            rows = index[written : written + end - first]
            for layer in range(pool.num_layers):
                for side, cache in enumerate((pool.k[layer], pool.v[layer])):
                    src = block[layer, side, first:end].to(device)
                    if run is None:
                        storage_view(cache).index_copy_(0, rows, src)
                    else:  # one range of rows: a plain copy, cheaper than the row scatter
                        storage_view(cache).narrow(0, run, end - first).copy_(src)
            written += end - first
        start += block.shape[2]


def consecutive_start(slots: torch.Tensor) -> int | None:
    """The first slot when `slots` (on the CPU) are consecutive ascending (freed runs come back whole), else None."""
    base = int(slots[0])
    return base if torch.equal(slots, torch.arange(base, base + slots.numel(), dtype=slots.dtype)) else None
