"""Rotary position embedding (RoPE) for the Llama family: the settings from a transformers config, the
inverse frequencies with linear or llama3 scaling, and the rotate-half rotation (the HF layout)."""

from __future__ import annotations

import math

import torch

from sgl_lite.runtime.kernels import ops
from sgl_lite.runtime.kernels.loader import has_op


def rope_parameters(config) -> dict:
    """RoPE settings from transformers 5 (`rope_parameters`) or 4 (`rope_theta` + `rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with linear or llama3 scaling applied.

    Computed in float32 exactly as transformers does, so fp32 logits match it closely at long positions.
    """
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        # Between the two wavelength thresholds, interpolate between scaled and unscaled.
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the HF layout). x [N, H, D]; cos/sin [N, 1, D/2] in x's dtype.

    On CPU, in bf16 or float32 with each row's heads contiguous (q and k as a view of the qkv matmul's
    output), the C++ op of kernels/csrc/layer/rotary_embedding.cpp when built: one pass with torch's bits instead
    of seven ops over the whole tensor. The decode layer's op rotates with the same code (csrc/layer/rope.h)."""
    if (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and cos.dtype == sin.dtype == x.dtype
            and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and has_op("rotary_embedding")):
        return ops.rotary_embedding(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
