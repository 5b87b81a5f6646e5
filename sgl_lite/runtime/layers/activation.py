"""The MLP's gated activation, silu(gate) * up, over the gate_up matmul's output [rows, 2 * intermediate]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_lite.runtime.kernels import ops
from sgl_lite.runtime.kernels.loader import has_op


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:]. On CPU the C++ op of kernels/csrc/layer/silu_and_mul.cpp when built:
    one pass in bf16 with torch's bits (silu looked up in a table of torch's own silu of every bf16 value,
    the product rounded as torch rounds it); torch's own ops for every other dtype. The decode layer's op
    (csrc/layer/decode_layer.cpp) calls the same op, so a token gets the same bits on the prefill and decode paths."""
    if gate_up.device.type == "cpu" and has_op("silu_and_mul"):
        return ops.silu_and_mul(gate_up)
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
