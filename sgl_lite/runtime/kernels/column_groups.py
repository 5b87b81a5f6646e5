"""The order in which the small-row matmul kernels (csrc/matmul/bf16_gemv.cpp, csrc/matmul/w8a8_gemm.cpp) read a packed
weight: its blocks of 16 output columns in groups of GROUP, each group's blocks interleaved along the
reduction axis, so that a register tile (one group) reads one stream. A weight is given block by block as
[blocks, steps, ...] (steps along the reduction axis, each step one 64-byte vector of the block); a group
becomes [steps][GROUP][...], a last group of fewer blocks [steps][its blocks][...]."""

from __future__ import annotations

import torch

GROUP = 3  # blocks per group: a register tile's (the kernels' kGroup)


def interleave_groups(blocks: torch.Tensor) -> torch.Tensor:
    """[blocks, steps, ...] block by block -> the kernels' order, flat."""
    whole = blocks.shape[0] // GROUP * GROUP
    parts = [blocks[:whole].reshape(-1, GROUP, *blocks.shape[1:]).transpose(1, 2).reshape(-1)]
    if whole < blocks.shape[0]:
        parts.append(blocks[whole:].transpose(0, 1).reshape(-1))
    return torch.cat(parts)


def deinterleave_groups(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The inverse of interleave_groups: `packed` (any shape, in the kernels' order) back to `shape`,
    [blocks, steps, ...] block by block."""
    flat, whole = packed.reshape(-1), shape[0] // GROUP * GROUP
    per_block = flat.numel() // shape[0]
    grouped = flat[: whole * per_block].reshape(-1, shape[1], GROUP, *shape[2:]).transpose(1, 2).reshape(whole, *shape[1:])
    if whole == shape[0]:
        return grouped
    tail = flat[whole * per_block :].reshape(shape[1], shape[0] - whole, *shape[2:]).transpose(0, 1)
    return torch.cat([grouped, tail])
