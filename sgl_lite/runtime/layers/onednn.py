"""What oneDNN (torch's CPU matmul library) offers on this CPU, probed once per process."""

from __future__ import annotations

import functools

import torch


@functools.cache
def onednn_bf16_supported() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: it needs AVX512 (BW/VL/DQ) or AVX-NE-CONVERT and
    refuses elsewhere (an AVX2-only CPU, say), which only trying tells."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


@functools.cache
def amx_matmuls() -> bool:
    """Whether oneDNN's bf16 and int8 matmuls run on AMX tiles here (a CPU with AMX whose kernel lets the
    process use them, and oneDNN's bf16 packing available): then they outrun sgl_lite's AVX-512 kernels
    on calls of more than a few rows (docs/performance.md, "On CPUs with AMX")."""
    tiles = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(tiles is not None and tiles()) and onednn_bf16_supported()
