"""`--quantization w4a8_int4`'s calls of few rows on AVX512-VNNI: Int4Values (groups of 32, w = scale * q + min)
packed for csrc/matmul/w4a8_gemm.cpp, which multiplies the 4-bit values by int8 activations (a scale per row,
taken from the row at each call).

`reference_matmul` is the kernel's arithmetic in torch (exact integer sums per group, then float32 sums over
the groups): the tests' oracle, within float32 rounding (the kernel fuses its multiply-adds).
"""

from __future__ import annotations

import functools

import torch

from sgl_lite.runtime.kernels.column_groups import deinterleave_groups, interleave_groups
from sgl_lite.runtime.layers.quantization.w8a8 import quantize_rows
from sgl_lite.runtime.layers.quantization.weight_only import (
    INT4_GROUP_SIZE,
    Int4Values,
    fp16_block_bytes,
    padded_small_row_matmul,
)

_COLUMNS = 16  # output columns per packed block; rows are padded to a multiple
_VECTOR_K = 8  # k per 64-byte vector: 16 columns x 4 k in the low nibbles, the next 4 k in the high ones


@functools.cache
def w4a8_kernel_available() -> bool:
    from sgl_lite.runtime.kernels.loader import runs_here

    return runs_here("w4a8_gemm")


class W4A8Int4:
    """Int4Values packed for csrc/matmul/w4a8_gemm.cpp: uint8 [N/16, K/32 * 320]; per block of 16 output columns and
    group of 32 k, four 64-byte vectors of nibbles (byte 4c + j: column c's k = 8v + j low, 8v + 4 + j high), then
    the 16 columns' scales and mins as fp16; the blocks in groups of three, vector by vector
    (kernels/column_groups.py). Rows are padded to a multiple of 16 (their outputs sliced off)."""

    def __init__(self, values: Int4Values) -> None:
        n, k = values.q.shape
        self.out_features, self.in_features = n, k
        self.pad = -n % _COLUMNS
        blocks, groups = (n + self.pad) // _COLUMNS, k // INT4_GROUP_SIZE
        q = torch.cat([values.q, values.q.new_zeros(self.pad, k)]) if self.pad else values.q
        # [block, column, group, vector, half, j] -> [block, group, vector, column, j, half]
        q = q.reshape(blocks, _COLUMNS, groups, INT4_GROUP_SIZE // _VECTOR_K, 2, 4).permute(0, 2, 3, 1, 5, 4)
        nibbles = (q[..., 0] | (q[..., 1] << 4)).reshape(blocks, groups, -1, 64)  # 4 vectors of 64 bytes
        trailer = torch.cat([fp16_block_bytes(values.scales, self.pad), fp16_block_bytes(values.mins, self.pad)],
                            dim=-1)[:, :, None]  # [block, group, 1, 64]
        steps = torch.cat([nibbles, trailer], dim=2).reshape(blocks, groups * 5, 64)
        self.packed = interleave_groups(steps).reshape(blocks, -1)

    def unpacked(self) -> Int4Values:
        """The values as the kernel reads them from `packed` (scales and mins rounded to fp16)."""
        n, k = self.out_features, self.in_features
        blocks, groups = self.packed.shape[0], k // INT4_GROUP_SIZE
        steps = deinterleave_groups(self.packed, (blocks, groups * 5, 64)).reshape(blocks, groups, 5, 64)
        nibbles = steps[:, :, :4].reshape(blocks, groups, 4, _COLUMNS, 4)  # [block, group, vector, column, j]
        q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1)  # [..., j, half]
        q = q.permute(0, 3, 1, 2, 5, 4).reshape(blocks * _COLUMNS, k)[:n]

        def per_column(part: torch.Tensor) -> torch.Tensor:  # fp16 bytes [block, group, 32] -> [N, G]
            return part.contiguous().view(torch.float16).float().transpose(1, 2).reshape(-1, groups)[:n]

        return Int4Values(q.contiguous(), per_column(steps[:, :, 4, :32]), per_column(steps[:, :, 4, 32:]))

    @property
    def fused_decode_weight(self) -> bool:
        """Whether csrc/layer/decode_layer.cpp may call the kernel on `packed` itself: unpadded."""
        return self.pad == 0

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return padded_small_row_matmul("w4a8_gemm", x, self.packed, bias, self.pad)

    def reference_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel's arithmetic in torch: per group exact integer sums, then scale * sum + min * (the group's
        sum of activations) over the groups in order (float64 here, float32 in the kernel), times the row scale."""
        qx, row_scale = quantize_rows(x)
        values, m, (n, k) = self.unpacked(), x.shape[0], (self.out_features, self.in_features)
        groups = k // INT4_GROUP_SIZE
        xg = qx.double().reshape(m, groups, INT4_GROUP_SIZE)
        wg = values.q.double().reshape(n, groups, INT4_GROUP_SIZE)
        sums = torch.einsum("mgk,ngk->mng", xg, wg)  # exact: integers below 2^53
        acc = (sums * values.scales.double()[None] + xg.sum(-1)[:, None, :] * values.mins.double()[None]).sum(-1)
        out = acc * row_scale.double()[:, None]
        if bias is not None:
            out = out + bias.double()
        return out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()
