"""RMSNorm, fused with the residual add, as the Llama family's decoder layers use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl_lite.runtime.kernels import ops
from sgl_lite.runtime.kernels.loader import has_op


class RMSNorm(nn.Module):
    """RMSNorm, optionally of `x + residual` (returning that sum too, the next residual).

    On CPU it runs the C++ op of kernels/csrc/layer/rms_norm.cpp when it is built: one pass per row with
    transformers' roundings, several times faster at decode sizes than torch's composite rms_norm (whose
    ~8 ops are mostly dispatch there), which a decode step calls twice per layer. Elsewhere torch's
    rms_norm (float32 accumulation; in bf16 one rounding step apart from transformers, which casts back
    before scaling).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.cpu_op = device.type == "cpu" and has_op("rms_norm") and has_op("add_rms_norm")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.cpu_op:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        total = x + residual
        return F.rms_norm(total, self.weight.shape, self.weight, self.eps), total
