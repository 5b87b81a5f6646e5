"""Attention backends over the paged KV pool: torch_native (any device), cpu_kernel (CPU), flashinfer (CUDA)."""

from __future__ import annotations

import logging

import torch

from sgl_lite.runtime.layers.attention.base import AttentionBackend, AttentionMetadata
from sgl_lite.runtime.layers.attention.torch_native import TorchNativeBackend

logger = logging.getLogger(__name__)


def create_backend(
    name: str, device: torch.device, num_q_heads: int, num_kv_heads: int, head_dim: int, deterministic: bool = False
) -> AttentionBackend:
    """`name` is ServerArgs.attention_backend.

    auto picks flashinfer on CUDA and cpu_kernel on CPU. cpu_kernel falls back to torch_native (with one
    log line) when its C++ op cannot be built here or does not support the model's head layout.
    `deterministic` (--enable-deterministic-inference) picks the batch-invariant backend instead.
    """
    if deterministic:
        from sgl_lite.runtime.layers.attention.batch_invariant import BatchInvariantBackend

        return BatchInvariantBackend(num_q_heads, num_kv_heads, head_dim)
    if name == "auto":
        name = "flashinfer" if device.type == "cuda" else "cpu_kernel"
    if name == "torch_native":
        return TorchNativeBackend(num_q_heads, num_kv_heads, head_dim)
    if name == "cpu_kernel":
        return _cpu_kernel_or_torch(device, num_q_heads, num_kv_heads, head_dim)
    if name == "flashinfer":
        from sgl_lite.runtime.layers.attention.flashinfer import FlashInferBackend

        return FlashInferBackend(num_q_heads, num_kv_heads, head_dim, device=device)
    raise ValueError(f"unknown attention backend {name!r}; expected auto, torch_native, cpu_kernel or flashinfer")


def _cpu_kernel_or_torch(device: torch.device, num_q_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    from sgl_lite.runtime.kernels import ops
    from sgl_lite.runtime.kernels.loader import has_op
    from sgl_lite.runtime.layers.attention.cpu_kernel import CpuKernelBackend, kernel_supports

    if device.type != "cpu":
        raise ValueError(f"the cpu_kernel attention backend runs on CPU, not {device.type}")
    if not kernel_supports(num_q_heads, num_kv_heads, head_dim):
        logger.warning("cpu_kernel does not support %d query / %d KV heads of dim %d: using torch_native",
                       num_q_heads, num_kv_heads, head_dim)
        return TorchNativeBackend(num_q_heads, num_kv_heads, head_dim)
    if not has_op("paged_decode_attention"):  # the loader logs its own line when it cannot be built
        return TorchNativeBackend(num_q_heads, num_kv_heads, head_dim)
    return CpuKernelBackend(num_q_heads, num_kv_heads, head_dim, ops.paged_decode_attention)


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchNativeBackend", "create_backend"]
