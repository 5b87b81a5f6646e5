"""`--quantization w8a8_int8` (SGLang's name): int8 weights with a scale per output column, and int8
activations with a scale per row taken from the row itself at every call (dynamic, per token).

Unlike the weight-only methods, the products are integer ones, which is what makes it fast where bf16
arithmetic is slow: csrc/w8a8_gemm.cpp multiplies 64 byte pairs per AVX512-VNNI instruction, so a prefill's
matmuls run ~4x the bf16 kernel's rate on a CPU whose VDPBF16PS is the bottleneck, and a decode step
streams half the weight bytes. It takes every call, prefill included, so no packed dense copy is made for
it (the model's own parameter stays).

`reference_matmul` is the same arithmetic in torch (torch._int_mm): the tests' oracle, bit for bit, and the
path where the kernel is not built (CPUs without AVX512-VNNI, BW and VL).
"""

from __future__ import annotations

import functools

import torch

_COLUMNS = 16  # output columns per packed block; rows are padded to a multiple
_K_GROUP = 4  # k per VPDPBUSD lane; K is padded to a multiple
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def w8a8_kernel_available() -> bool:
    from sgl_lite.runtime.layers.cpu_ops import load_cpu_ops

    return load_cpu_ops() and bool(torch.ops.sgl_lite.w8a8_gemm_supported())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: q = round_half_even(x * 127 / max|x|) as int8, and the scale max|x| / 127 (float32). A row
    whose 127 / max|x| is not finite (all zeros, or max|x| below 127 / FLT_MAX) quantizes to zeros."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # a true division (`127.0 / amax` is computed as amax.reciprocal() * 127: another rounding than the kernel's)
    ratio = torch.full_like(amax, 127.0).div(amax)
    inv = torch.where(torch.isfinite(ratio), ratio, torch.zeros_like(ratio))
    return torch.round(xf * inv[:, None]).to(torch.int8), amax / 127.0


class W8A8Int8:
    """A weight [N, K] as int8 with a float32 scale per output column (max|row| / 127), packed for
    csrc/w8a8_gemm.cpp: int8 [N/16, ceil(K/4) * 64 + 128], per 16 columns the K/4 vectors of 16 columns x
    4 k, then the columns' scales and compensations (-128 * the column's sum, for the kernel's unsigned
    activations). Rows are padded to a multiple of 16 (their outputs sliced off)."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self.out_features, self.in_features = n, k = w.shape
        self.scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # float32 [N]
        q_rows = torch.round(w / self.scales[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        # [N, K] int8 for the torch reference; kept only where it is the path (no kernel), else unpacked on demand
        self._q: torch.Tensor | None = None if w8a8_kernel_available() else q_rows
        self.pad = -n % _COLUMNS
        k4 = -(-k // _K_GROUP)
        q = torch.zeros(n + self.pad, k4 * _K_GROUP, dtype=torch.int8)
        q[:n, :k] = q_rows
        scales = torch.cat([self.scales, self.scales.new_ones(self.pad)])
        comp = -128 * q.sum(dim=1, dtype=torch.int32)
        blocks = (n + self.pad) // _COLUMNS
        lines = q.reshape(blocks, _COLUMNS, k4, _K_GROUP).permute(0, 2, 1, 3).reshape(blocks, -1)
        trailer = torch.cat([scales.reshape(blocks, _COLUMNS).view(torch.int8), comp.reshape(blocks, _COLUMNS).view(torch.int8)], 1)
        self.packed = torch.cat([lines, trailer], dim=1).contiguous()

    @property
    def q(self) -> torch.Tensor:
        """The int8 weight [N, K] (unpacked from `packed` the first time where the kernel is the path)."""
        if self._q is None:
            blocks, k4 = self.packed.shape[0], -(-self.in_features // _K_GROUP)
            lines = self.packed[:, : k4 * _COLUMNS * _K_GROUP].reshape(blocks, k4, _COLUMNS, _K_GROUP)
            self._q = lines.permute(0, 2, 1, 3).reshape(blocks * _COLUMNS, -1)[: self.out_features, : self.in_features].contiguous()
        return self._q

    @property
    def fused_decode_weight(self) -> bool:
        """Whether csrc/decode_layer.cpp may call the kernel on `packed` itself: built, and unpadded."""
        return self.pad == 0 and w8a8_kernel_available()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not w8a8_kernel_available() or x.dtype not in _KERNEL_DTYPES:
            return self.reference_matmul(x, bias)
        if bias is not None and self.pad:
            bias = torch.cat([bias, bias.new_zeros(self.pad)])
        out = torch.ops.sgl_lite.w8a8_gemm(x.contiguous(), self.packed, bias)
        return out[:, : self.out_features] if self.pad else out

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
