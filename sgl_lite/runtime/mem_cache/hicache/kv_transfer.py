"""KV between the pool's slots and the tier's blocks: a block is one tensor [layers, 2 (K, V), tokens, heads, dim].

Blocks keep the pool's bytes exactly (an fp8 pool's as uint8), so a block written and read back restores the
same bits in whatever slots it lands in. Gathers return CPU tensors (what the disk takes); `write_block` takes
one and moves it to the pool's device.
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


def write_block(pool: KVPool, block: torch.Tensor, skip: int, slots: torch.Tensor) -> None:
    """Write tokens [skip, skip + len(slots)) of one block ([layers, 2, tokens, heads, dim], on the CPU) into `slots`
    of every layer, straight from the block's memory. On a CPU pool the copy runs on the calling thread alone:
    the C++ op (csrc/common/write_kv_rows.cpp, one call a block without the GIL) where the runtime loaded it, else numpy
    (a call a layer and side), so the tier's read threads copy beside the scheduler's forward without torch's threads."""
    end = skip + slots.numel()
    if skip < 0 or end > block.shape[2]:
        raise ValueError(f"write_block: tokens [{skip}, {end}) outside the block's {block.shape[2]}")
    if not slots.numel():
        return
    if pool.k[0].device.type != "cpu":
        index = slots.to(pool.k[0].device)
        for layer in range(pool.num_layers):
            for side, cache in enumerate((pool.k[layer], pool.v[layer])):
                storage_view(cache).index_copy_(0, index, block[layer, side, skip:end].to(index.device))
    elif has_write_kv_rows():
        torch.ops.sgl_lite.write_kv_rows(block, pool.k, pool.v, skip, slots.cpu())
    else:
        src, rows = block.view(torch.uint8).numpy(), slots.cpu().numpy()  # [layers, 2, tokens, heads, dim bytes]
        for layer in range(pool.num_layers):
            for side, cache in enumerate((pool.k[layer], pool.v[layer])):
                cache.view(torch.uint8).numpy()[rows] = src[layer, side, skip:end]


def has_write_kv_rows() -> bool:
    """Whether the C++ CPU ops, loaded by the model's runner (kernels/loader.py, a layer above this one), hold
    `write_kv_rows`."""
    try:
        getattr(torch.ops.sgl_lite, "write_kv_rows")
    except (AttributeError, RuntimeError):
        return False
    return True
