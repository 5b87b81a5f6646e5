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
    """The KV of `slots` (a whole number of blocks, in token order) as a CPU tensor [blocks, *block_shape]."""
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
    """Write tokens [skip, skip + len(slots)) of the concatenated `blocks` into `slots` of every layer."""
    joined = torch.stack(blocks).permute(1, 2, 0, 3, 4, 5)  # [layers, 2, blocks, tokens, heads, dim]
    layers, _, num_blocks, block_tokens = joined.shape[:4]
    if skip < 0 or skip + slots.numel() > num_blocks * block_tokens:
        raise ValueError(f"scatter_blocks: tokens [{skip}, {skip + slots.numel()}) outside {num_blocks} blocks")
    flat = joined.reshape(layers, 2, num_blocks * block_tokens, pool.kv_heads, pool.head_dim)
    device = pool.k[0].device
    index = slots.to(device)
    for layer in range(pool.num_layers):
        for side, cache in enumerate((pool.k[layer], pool.v[layer])):
            rows = flat[layer, side, skip : skip + slots.numel()].to(device)
            storage_view(cache).index_copy_(0, index, rows)
