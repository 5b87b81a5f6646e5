"""Weight-only int8 and int4 weights for torch's CPU kernels (activations stay in the model dtype).

- Int8WeightOnly: one symmetric scale per output row; `aten._weight_int8pack_mm`.
- Int4WeightOnly: groups of 32 input columns, each with a scale and a minimum (w = scale * q + min,
  q in 0..15: GGUF's Q4_1 layout, and Q4_0 is the case min = -8 * scale); the weight is repacked
  once by `aten._convert_weight_to_int4pack_for_cpu` and multiplied by
  `aten._weight_int4pack_mm_for_cpu`, whose per-group pair is (scale, zero) with
  w = (q - 8) * scale + zero, so zero = min + 8 * scale.
- Int4Avx2: the same values for sgl_lite's own kernel (kernels/csrc/matmul/avx2_q4_gemv.cpp), which keeps each
  group's scale and min as fp16 (as GGUF does) and is the faster of the two on CPUs without AVX-512.

`Int8WeightOnly.dequantize()` and `Int4Values.dequantize()` give the float32 weight the kernels
compute with (up to the cast of the scales to the activations' dtype): the tests' reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_lite.runtime.kernels import ops

INT4_GROUP_SIZE = 32  # GGUF's Q4 block size; also the smallest group the CPU kernel accepts
_INT4_ROW_MULTIPLE = 16  # the int4 packing needs N % 16 == 0: pad rows, slice the output
_INT4_INNER_K_TILES = 1  # the CPU kernel's only packing parameter; its layout ignores tiles beyond 1
_AVX2_INT4_COLUMNS = 16  # output columns per block of csrc/matmul/avx2_q4_gemv.cpp: rows are padded to a multiple


class Int8WeightOnly:
    """[N, K] int8 weight with one scale per output row."""

    fused_decode_weight = False  # csrc/layer/decode_layer.cpp cannot call its kernel

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        if weight.dtype != torch.int8 or weight.dim() != 2 or scales.shape != (weight.shape[0],):
            raise ValueError(f"int8 weight [N, K] with scales [N] expected; got {tuple(weight.shape)} "
                             f"{weight.dtype}, scales {tuple(scales.shape)}")
        self.weight = weight.contiguous()
        self.scales = scales
        self.out_features, self.in_features = weight.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int8WeightOnly:
        """Round-to-nearest with scale = max|row| / 127."""
        w = weight.detach().float()
        # the scales as the kernel will read them (rounded to the activations' dtype)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(dtype)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return out if bias is None else out + bias

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * self.scales.element_size()


@dataclass(frozen=True)
class Int4Values:
    """[N, K] 4-bit values in groups of INT4_GROUP_SIZE input columns: w = scale * q + min.

    The loading form (from GGUF blocks or quantized from a dense weight), before packing.
    """

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scales: torch.Tensor  # [N, K / INT4_GROUP_SIZE] float32
    mins: torch.Tensor  # same shape

    def __post_init__(self) -> None:
        n, k = self.q.shape
        groups = k // INT4_GROUP_SIZE
        if k % INT4_GROUP_SIZE or self.scales.shape != (n, groups) or self.mins.shape != (n, groups):
            raise ValueError(f"int4 weight [N, K] with K % {INT4_GROUP_SIZE} == 0 and scales/mins [N, K/"
                             f"{INT4_GROUP_SIZE}] expected; got {tuple(self.q.shape)}, {tuple(self.scales.shape)}, "
                             f"{tuple(self.mins.shape)}")
        if self.q.numel() and int(self.q.max()) > 15:
            raise ValueError("int4 values must lie in 0..15")

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Values:
        """Per group: min and max map to 0 and 15 (Q4_1's scheme), round to nearest in between; scales and
        mins are fp16 values, as Q4_1 stores them."""
        w = weight.detach().float()
        n, k = w.shape
        if k % INT4_GROUP_SIZE:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP_SIZE}; got {k}")
        groups = w.reshape(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        mins, maxs = groups.amin(dim=-1).half().float(), groups.amax(dim=-1)
        scales = ((maxs - mins) / 15.0).half().float()
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round((groups - mins[..., None]) / safe[..., None]).clamp(0, 15).reshape(n, k)
        return cls(q.to(torch.uint8), scales, mins)

    @staticmethod
    def cat(parts: list[Int4Values]) -> Int4Values:
        """Rows of several weights stacked (fused q/k/v or gate/up)."""
        return Int4Values(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.mins for p in parts]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.q.float().reshape(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        return (groups * self.scales[..., None] + self.mins[..., None]).reshape(n, k)


def padded_small_row_matmul(kernel: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                            pad: int) -> torch.Tensor:
    """ops.small_row_matmul over a weight whose rows were padded by `pad` zero rows: the bias padded to
    match, the padded outputs sliced off."""
    if bias is not None and pad:
        bias = torch.cat([bias, bias.new_zeros(pad)])
    out = ops.small_row_matmul(kernel, x, packed, bias)
    return out[:, : out.shape[1] - pad] if pad else out


def fp16_block_bytes(per_group: torch.Tensor, pad: int, columns: int = 16) -> torch.Tensor:
    """Per-group scales or mins [N, G], N padded by `pad` zero rows, as fp16 bytes [N/columns, G, 2 * columns]:
    each block of `columns` output columns, group by group (the int4 kernels' layout)."""
    groups = per_group.shape[1]
    half = torch.cat([per_group, per_group.new_zeros(pad, groups)]).half()
    if not torch.isfinite(half).all():
        raise ValueError("int4 scales and mins must fit fp16")
    return half.reshape(-1, columns, groups).transpose(1, 2).contiguous().view(torch.uint8)


class Int4WeightOnly:
    """Int4Values packed for the CPU kernel; scales and zeros in the activations' dtype."""

    fused_decode_weight = False  # csrc/layer/decode_layer.cpp cannot call its kernel

    def __init__(self, values: Int4Values, dtype: torch.dtype) -> None:
        n, k = values.q.shape
        self.out_features, self.in_features = n, k
        pad = -n % _INT4_ROW_MULTIPLE
        q = torch.cat([values.q.to(torch.int32), torch.full((pad, k), 8, dtype=torch.int32)])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), _INT4_INNER_K_TILES)
        pairs = torch.stack([values.scales, values.mins + 8.0 * values.scales], dim=-1)  # [N, G, 2]
        pairs = torch.cat([pairs, pairs.new_zeros(pad, *pairs.shape[1:])])
        self.scales_and_zeros = pairs.transpose(0, 1).contiguous().to(dtype)  # [G, N_padded, 2]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP_SIZE, self.scales_and_zeros)
        out = out if out.shape[1] == self.out_features else out[:, : self.out_features]
        return out if bias is None else out + bias

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()


class Int4Avx2:
    """Int4Values packed for csrc/matmul/avx2_q4_gemv.cpp: uint8 [N/16, K/32, 320] blocks of 16 output columns x 32
    k, each 32 lines of 8 bytes (column j's q in the low nibble of byte j, column j + 8's in the high one)
    followed by the 16 columns' scales and mins as fp16. Rows are padded to a multiple of 16."""

    def __init__(self, values: Int4Values) -> None:
        n, k = values.q.shape
        self.out_features, self.in_features = n, k
        self.pad = -n % _AVX2_INT4_COLUMNS
        q = torch.cat([values.q, values.q.new_zeros(self.pad, k)]) if self.pad else values.q
        tiles, groups = q.shape[0] // _AVX2_INT4_COLUMNS, k // INT4_GROUP_SIZE
        q = q.reshape(tiles, _AVX2_INT4_COLUMNS, groups, INT4_GROUP_SIZE).permute(0, 2, 3, 1)  # [tile, group, k, column]
        lines = q[..., :8] | (q[..., 8:] << 4)  # [tile, group, 32, 8]

        self.packed = torch.cat([lines.reshape(tiles, groups, -1), fp16_block_bytes(values.scales, self.pad),
                                 fp16_block_bytes(values.mins, self.pad)], dim=-1).contiguous()

    @property
    def fused_decode_weight(self) -> bool:
        """Whether csrc/layer/decode_layer.cpp may call the kernel on `packed` itself: unpadded (it slices no outputs)."""
        return self.pad == 0

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The bias is added inside the kernel, before rounding, as csrc/layer/decode_layer.cpp does."""
        return padded_small_row_matmul("avx2_q4_gemv", x, self.packed, bias, self.pad)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


QuantizedWeight = Int8WeightOnly | Int4WeightOnly | Int4Avx2
