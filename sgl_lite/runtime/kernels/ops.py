"""The C++ CPU ops as Python functions: what each takes and returns, in one place.

Callers ask `loader.runs_here(name)` first (built here, and this CPU runs it) and keep a torch path for
when it does not. Each wrapper makes its inputs contiguous where the kernel reads raw rows; each op is
tested against a torch reference in tests/ (test_<op>_op.py, test_gemv.py, test_attention_cpu_kernel.py).
"""

from __future__ import annotations

import torch

_ops = torch.ops.sgl_lite


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [n, d] (transformers' roundings)."""
    return _ops.rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual), the residual add fused in."""
    return _ops.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [n, 2 * inter] (torch's bits)."""
    return _ops.silu_and_mul(gate_up)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [n, heads, dim] (torch's seven-op expression, its bits)."""
    return _ops.rotary_embedding(x, cos, sin)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of float32 logits [n, vocab], as torch.argmax answers it (first largest, NaN largest)."""
    return _ops.argmax_rows(logits.contiguous())


def small_row_matmul(kernel: str, x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T through the small-row kernel `kernel` (bf16_gemv, avx2_gemv, avx2_q4_gemv, w8a8_gemm,
    w8a16_gemm, w4a8_gemm) over its packed weight."""
    return getattr(_ops, kernel)(x.contiguous(), packed_weight, bias)


def w8a8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] quantized as w8a8_gemm quantizes it: (q + 128 as uint8 [M, K], float32 scales [M])."""
    return _ops.w8a8_quantize_rows(x.contiguous())


def amx_w8a8_gemm(xq: torch.Tensor, row_scale: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """w8a8_gemm's result on AMX tiles from rows quantized by w8a8_quantize_rows (K a multiple of 64)."""
    return _ops.amx_w8a8_gemm(xq, row_scale, packed_weight, bias, dtype)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, requests: torch.Tensor,
                     kv_indices: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Prefill/extend attention of q's rows over the paged pool, written into `out`."""
    _ops.extend_attention(q.contiguous(), k_cache, v_cache, requests, kv_indices, scale, out)


def amx_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, requests: torch.Tensor,
                         kv_indices: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """As extend_attention, on AMX tiles: bf16 q, out and pool, head_dim a multiple of 32."""
    _ops.amx_extend_attention(q.contiguous(), k_cache, v_cache, requests, kv_indices, scale, out)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, scale: float, qo_indptr: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention: each row's queries (one, or 1 + draft tokens by qo_indptr) over its paged K/V."""
    return _ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale, qo_indptr)


def decode_layer(*operands: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's decoder layer as one op (models/llama.py assembles its operands)."""
    return _ops.decode_layer(*operands)


def bf16_gemv_arithmetic() -> str:
    """The bf16 arithmetic bf16_gemv's probe chose on this core: "fma" or "dpbf16"."""
    return _ops.bf16_gemv_arithmetic()


def parallel_thread_ids() -> list[int]:
    """The OS thread ids of torch's parallel-region threads (-1 for one not started)."""
    return list(_ops.parallel_thread_ids())
