"""`--quantization w8a8_int8` (SGLang's name): int8 weights with a scale per output column, and int8
activations with a scale per row taken from the row itself at every call (dynamic, per token).

Unlike the weight-only methods, the products are integer ones, which is what makes it fast where bf16
arithmetic is slow: csrc/matmul/w8a8_gemm.cpp multiplies 64 byte pairs per AVX512-VNNI instruction, so a prefill's
matmuls run at a multiple of the bf16 kernel's rate on a CPU whose VDPBF16PS is the bottleneck, and a decode step
streams half the weight bytes. It takes every call, prefill included, so no packed dense copy is made for
it (the model's own parameter stays).

`reference_matmul` is the same arithmetic in torch (torch._int_mm): the tests' oracle, bit for bit, and the
path where the kernel is not built (CPUs without AVX512-VNNI, BW and VL). On a CPU with AMX, calls of more
than AMX_KERNEL_MAX_ROWS rows take csrc/matmul/amx_w8a8_gemm.cpp, which multiplies on the tile units over the same
packed weight and outruns VPDPBUSD on a prefill's many rows (docs/performance.md, "On CPUs with AMX"): the
rows quantized by the kernel's own op, exact integer sums and the kernel's epilogue, so a row gets the same
bits from both paths (where K is a multiple of 64 and the activations float32 or bf16; elsewhere every call
stays on the VNNI kernel).
"""

from __future__ import annotations

import functools

import torch

from sgl_lite.runtime.kernels import ops
from sgl_lite.runtime.kernels.column_groups import deinterleave_groups, interleave_groups
from sgl_lite.runtime.layers.onednn import amx_matmuls

_COLUMNS = 16  # output columns per packed block; rows are padded to a multiple
_K_GROUP = 4  # k per VPDPBUSD lane; K is padded to a multiple
_VECTOR = _COLUMNS * _K_GROUP  # bytes per packed vector: 16 columns x 4 k
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# With AMX, calls of more rows than this run on the AMX kernel, fewer on the VNNI kernel (which streams
# the weights a little faster at a few rows; the AMX kernel's rate grows with the rows from there).
AMX_KERNEL_MAX_ROWS = 8
_AMX_K_MULTIPLE = 64  # the AMX kernel's tile step along K


@functools.cache
def w8a8_kernel_available() -> bool:
    from sgl_lite.runtime.kernels.loader import runs_here

    return runs_here("w8a8_gemm")


@functools.cache
def amx_int8_rows() -> bool:
    """Whether calls of many rows take csrc/matmul/amx_w8a8_gemm.cpp: AMX tiles here, and the kernels' ops built."""
    from sgl_lite.runtime.kernels.loader import has_op, runs_here

    return amx_matmuls() and w8a8_kernel_available() and has_op("w8a8_quantize_rows") and runs_here("amx_w8a8_gemm")


def quantize_rows(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: q = round_half_even(x * M / max|x|) with M = 2^(bits-1) - 1 (int8 for 8 bits, int32 for 16), and
    the scale max|x| / M (float32). A row whose M / max|x| is not finite (all zeros, or max|x| below
    M / FLT_MAX) quantizes to zeros."""
    largest = float(2 ** (bits - 1) - 1)
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # a true division (`M / amax` is computed as amax.reciprocal() * M: another rounding than the kernel's)
    ratio = torch.full_like(amax, largest).div(amax)
    inv = torch.where(torch.isfinite(ratio), ratio, torch.zeros_like(ratio))
    q = torch.round(xf * inv[:, None])
    return q.to(torch.int8 if bits == 8 else torch.int32), amax / largest


class W8A8Int8:
    """A weight [N, K] as int8 with a float32 scale per output column (max|row| / 127), packed for
    csrc/matmul/w8a8_gemm.cpp: int8 sized [N/16, ceil(K/4) * 64 + 128]. Per block of 16 columns, K/4 + 2 vectors of
    64 bytes: 16 columns x 4 k each, then the columns' float32 scales, then their int32 compensations (-128 *
    the column's sum, for the kernel's unsigned activations); the blocks in groups of three, vector by
    vector (kernels/column_groups.py). Rows are padded to a multiple of 16 (their outputs sliced off)."""

    kernel = "w8a8_gemm"  # the op of csrc/matmul/w8a8_gemm.cpp that multiplies by `packed`
    eight_bit_rows = True  # activations in 8 bits: the AMX kernel can take its calls of many rows

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self.out_features, self.in_features = n, k = w.shape
        self.scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # float32 [N]
        q_rows = torch.round(w / self.scales[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        # [N, K] int8 for the torch reference; kept only where it is the path (no kernel), else unpacked on demand
        self._q: torch.Tensor | None = None if w8a8_kernel_available() else q_rows
        self.amx_rows = self.eight_bit_rows and k % _AMX_K_MULTIPLE == 0 and amx_int8_rows()  # calls of many rows on AMX
        self.pad = -n % _COLUMNS
        k4 = -(-k // _K_GROUP)
        q = torch.zeros(n + self.pad, k4 * _K_GROUP, dtype=torch.int8)
        q[:n, :k] = q_rows
        scales = torch.cat([self.scales, self.scales.new_ones(self.pad)])
        comp = -128 * q.sum(dim=1, dtype=torch.int32)
        blocks = (n + self.pad) // _COLUMNS
        lines = q.reshape(blocks, _COLUMNS, k4, _K_GROUP).permute(0, 2, 1, 3).reshape(blocks, k4, _VECTOR)
        trailer = torch.stack([scales.reshape(blocks, _COLUMNS).view(torch.int8), comp.reshape(blocks, _COLUMNS).view(torch.int8)], 1)
        self.packed = interleave_groups(torch.cat([lines, trailer], 1)).reshape(blocks, -1)

    def _vectors(self) -> torch.Tensor:
        """`packed` block by block: [N/16, K/4 + 2, 64], each block's weight vectors, scales, compensations."""
        blocks = self.packed.shape[0]
        return deinterleave_groups(self.packed, (blocks, self.packed.shape[1] // _VECTOR, _VECTOR))

    @property
    def q(self) -> torch.Tensor:
        """The int8 weight [N, K] (unpacked from `packed` the first time where the kernel is the path)."""
        if self._q is None:
            blocks = self.packed.shape[0]
            lines = self._vectors()[:, :-2].reshape(blocks, -1, _COLUMNS, _K_GROUP)
            self._q = lines.permute(0, 2, 1, 3).reshape(blocks * _COLUMNS, -1)[: self.out_features, : self.in_features].contiguous()
        return self._q

    @property
    def fused_decode_weight(self) -> bool:
        """Whether csrc/layer/decode_layer.cpp may call the kernel on `packed` itself: built, and unpadded."""
        return self.pad == 0 and w8a8_kernel_available()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not w8a8_kernel_available() or x.dtype not in _KERNEL_DTYPES:
            return self.reference_matmul(x, bias)
        if bias is not None and self.pad:
            bias = torch.cat([bias, bias.new_zeros(self.pad)])
        if self.amx_takes(x.shape[0], x.dtype):
            q, row_scale = ops.w8a8_quantize_rows(x)
            out = ops.amx_w8a8_gemm(q, row_scale, self.packed, bias, x.dtype)
        else:
            out = ops.small_row_matmul(self.kernel, x, self.packed, bias)
        return out[:, : self.out_features] if self.pad else out

    def amx_takes(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a call of `rows` rows of `dtype` runs on csrc/matmul/amx_w8a8_gemm.cpp (float32 or bf16 output; its
        bits are the VNNI kernel's)."""
        return self.amx_rows and rows > AMX_KERNEL_MAX_ROWS and dtype in (torch.float32, torch.bfloat16)

    def reference_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel's arithmetic in torch: exact int32 sums, then sum * (row scale * column scale) + bias."""
        q, row_scale = quantize_rows(x)
        sums = torch._int_mm(q, self.q.t()) if q.shape[0] else torch.zeros(0, self.out_features, dtype=torch.int32)
        out = sums.float() * (self.scales[None, :] * row_scale[:, None])
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales[:, None]

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


class W8A16Int8(W8A8Int8):
    """W8A8Int8's packed int8 weight with 16-bit activations (csrc/matmul/w8a8_gemm.cpp's w8a16_gemm): each row as
    round_half_even(x * 32767 / max|x|), taken by the kernel in two bytes. The LM head of
    `--quantization w8a8_int8`: half the bytes of the bf16 head, and logits within the weights' own rounding
    (8-bit activations move them several times more). Not a decoder-layer weight (the fused decode layer
    calls w8a8_gemm)."""

    kernel = "w8a16_gemm"
    eight_bit_rows = False

    @property
    def fused_decode_weight(self) -> bool:
        return False

    @functools.cached_property
    def column_sums(self) -> torch.Tensor:
        """Each output column's sum of int8 weights (int32 [N]), read back once from the compensations packed
        with them (-128 * the sum), which is cheaper than summing the weights again."""
        comp = self._vectors()[:, -1].contiguous().view(torch.int32).reshape(-1)
        return comp[: self.out_features] // -128

    def reference_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel's arithmetic in torch: the row as U = q + 32768 in a high and a low byte, each byte's
        exact int32 sum of products (torch._int_mm, the bytes shifted into int8 and the shift added back per
        column), converted to float32, then one rounding of 256 * (high sum - 128 * column sum) + low sum
        (exact in float64: integers), times the row and column scales, plus the bias."""
        q, row_scale = quantize_rows(x, bits=16)
        u = q + 32768
        if not q.shape[0]:
            return torch.zeros(0, self.out_features, dtype=x.dtype)
        w = self.q.t()
        high = torch._int_mm(((u >> 8) - 128).to(torch.int8), w)  # the high byte's sum less 128 column sums
        low = torch._int_mm(((u & 255) - 128).to(torch.int8), w) + 128 * self.column_sums
        sums = (high.float().double() * 256 + low.float().double()).float()
        out = sums * (self.scales[None, :] * row_scale[:, None])
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)
