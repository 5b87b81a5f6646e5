"""Attention backends over the paged KV pool: torch_native (CPU, any device) and flashinfer (CUDA)."""

from __future__ import annotations

import torch

from sgl_lite.runtime.layers.attention.base import AttentionBackend, AttentionMetadata
from sgl_lite.runtime.layers.attention.torch_native import TorchNativeBackend


def create_backend(
    name: str, device: torch.device, num_q_heads: int, num_kv_heads: int, head_dim: int, deterministic: bool = False
) -> AttentionBackend:
    """`name` is ServerArgs.attention_backend: auto picks flashinfer on CUDA, torch_native elsewhere;
    `deterministic` (--enable-deterministic-inference) picks the batch-invariant backend instead."""
    if deterministic:
        from sgl_lite.runtime.layers.attention.batch_invariant import BatchInvariantBackend

        return BatchInvariantBackend(num_q_heads, num_kv_heads, head_dim)
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" else "torch_native"
    if name == "torch_native":
        return TorchNativeBackend(num_q_heads, num_kv_heads, head_dim)
    if name == "flashinfer":
        from sgl_lite.runtime.layers.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(num_q_heads, num_kv_heads, head_dim, device=device)
    raise ValueError(f"unknown attention backend {name!r}; expected auto, torch_native or flashinfer")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchNativeBackend", "create_backend"]
