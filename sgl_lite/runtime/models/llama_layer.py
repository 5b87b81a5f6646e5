"""The Llama-family decoder layer over a paged KV pool: fused QKV and gate-up projections, RoPE, attention
through an AttentionBackend, and on CPU decode steps the whole layer as one C++ op when every matmul of the
step takes a small-row kernel (kernels/csrc/layer/decode_layer.cpp). llama.py builds a model of these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sgl_lite.runtime.kernels import ops
from sgl_lite.runtime.kernels.loader import has_op
from sgl_lite.runtime.layers.activation import silu_and_mul
from sgl_lite.runtime.layers.attention.base import AttentionBackend, DecodeKernelInputs
from sgl_lite.runtime.layers.layernorm import RMSNorm
from sgl_lite.runtime.layers.linear import GemvLinear, QuantizedLinear, linear
from sgl_lite.runtime.layers.quantization.w8a8 import W8A8Int8
from sgl_lite.runtime.layers.rotary_embedding import apply_rope
from sgl_lite.runtime.mem_cache.memory_pool import KVPool


def param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate = config.intermediate_size
        self.qkv_weight = param((self.q_size + 2 * self.kv_size, hidden), dtype, device)
        self.qkv_bias = param((self.q_size + 2 * self.kv_size,), dtype, device) if qkv_bias else None
        self.o_weight = param((hidden, self.q_size), dtype, device)
        self.o_bias = param((hidden,), dtype, device) if o_bias else None
        self.gate_up_weight = param((2 * self.intermediate, hidden), dtype, device)
        self.down_weight = param((hidden, self.intermediate), dtype, device)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype, device)
        # oneDNN-packed copies or quantized forms of the four weights (see LlamaForCausalLM.pack_weights);
        # None = plain F.linear
        self.packed: dict[str, torch.Tensor | QuantizedLinear | None] = dict.fromkeys(("qkv", "o", "gate_up", "down"))
        # fused_decode_operands' last answer: (rows, the packed dict and the K cache it was made for, operands)
        self._decode_operands: tuple[int, dict, torch.Tensor, tuple | None] | None = None
        # Tensor parallelism (model_executor/tp.py) shards the heads and MLP columns and sets this to the
        # all-reduce of the o- and down-projection partial sums; None = one process, nothing to reduce.
        self.tp_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        attn: AttentionBackend, kv_pool: KVPool, kernel: DecodeKernelInputs | None = None, prefill: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it); their sum is the layer's hidden state.

        The residual add is left to the next norm, which fuses it (None: `hidden` is the embedding).
        `kernel` (a decode batch the paged decode kernel attends) lets a layer whose matmuls all take the
        small-row kernel run as one C++ op, bit-identical to the ops below (kernels/csrc/layer/decode_layer.cpp).
        `prefill`: the forward has prefill rows (its matmuls' row limits are then layers/linear.py's prefill ones)."""
        n = hidden.shape[0]
        packed = self.packed
        if kernel is not None and self.tp_reduce is None:
            operands = self.fused_decode_operands(n, kv_pool)
            if operands is not None:
                weights, caches, heads = operands
                return ops.decode_layer(hidden, residual, *weights, cos, sin, *caches, kernel.out_cache_loc,
                                        kernel.kv_indptr, kernel.kv_indices, *heads, kernel.scale, kernel.qo_indptr)
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        qkv = linear(normed, self.qkv_weight, self.qkv_bias, packed["qkv"], prefill)
        q, k = self.rotated_qk(qkv, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        attn_out = attn.forward(self.layer_id, q, k, v, kv_pool)
        attn_proj = linear(attn_out.reshape(n, self.q_size), self.o_weight, self.o_bias, packed["o"], prefill)
        if self.tp_reduce is not None:
            attn_proj = self.tp_reduce(attn_proj)
        normed, residual = self.post_attention_layernorm(attn_proj, residual)
        gate_up = linear(normed, self.gate_up_weight, None, packed["gate_up"], prefill)
        act = silu_and_mul(gate_up)
        down = linear(act, self.down_weight, None, packed["down"], prefill)
        return (down if self.tp_reduce is None else self.tp_reduce(down)), residual

    def rotated_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim] and k [n, kv_heads, head_dim] of the qkv matmul's output, RoPE applied."""
        # RoPE on q and k together: they are the first num_heads + num_kv_heads heads of qkv.
        qk = qkv[:, : self.q_size + self.kv_size].view(qkv.shape[0], self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :]

    def fused_decode_operands(self, rows: int, kv_pool: KVPool) -> tuple[tuple, tuple, tuple] | None:
        """What csrc/layer/decode_layer.cpp takes from this layer for a `rows`-row step - (norm weights and eps, the
        four matmuls' weights and biases), (its K and V caches), (head counts) - or None when the layer runs
        op by op (fused_decode_weights). Kept from the last call while the rows, the packed forms and the pool
        are the same objects: gathering them anew for each layer of each step costs a decode step measurably
        (docs/journal.md, "Glue around the kernels: a prefill's RoPE in one op, decode layers' operands
        kept")."""
        k_cache = kv_pool.k[self.layer_id]
        cached = self._decode_operands
        if cached is not None and cached[0] == rows and cached[1] is self.packed and cached[2] is k_cache:
            return cached[3]
        weights = self.fused_decode_weights(rows)
        operands = None
        if weights is not None:
            qkv, o, gate_up, down = weights
            operands = ((self.input_layernorm.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
                         qkv, self.qkv_bias, o, self.o_bias, gate_up, down),
                        (k_cache, kv_pool.v[self.layer_id]), (self.num_heads, self.num_kv_heads))
        self._decode_operands = (rows, self.packed, k_cache, operands)
        return operands

    def fused_decode_weights(self, rows: int) -> list[torch.Tensor] | None:
        """The qkv, o, gate_up and down weights of the kernels that all four matmuls of a `rows`-row call run
        when the fused layer takes them (a small-row kernel's, or the AVX2 int4 kernel's; a quantized form
        hands calls above its own row limit to its dense form) and RMSNorm has its C++ op; else None, and
        the layer runs op by op (so do w8a8 steps whose calls the AMX int8 kernel takes, which the fused layer
        does not call)."""
        if not self.input_layernorm.cpu_op or not has_op("decode_layer"):
            return None
        weights = []
        for form in self.packed.values():
            while isinstance(form, QuantizedLinear) and not form.takes(rows):
                form = form.packed_dense  # w4a8_int4's many-row form is itself a QuantizedLinear
            if isinstance(form, QuantizedLinear):
                if not form.quantized.fused_decode_weight:
                    return None
                if isinstance(form.quantized, W8A8Int8) and form.quantized.amx_takes(rows, self.input_layernorm.weight.dtype):
                    return None
                weights.append(form.quantized.packed)
                continue
            if not isinstance(form, GemvLinear) or not form.takes(rows):
                return None
            weights.append(form.gemv_weight)
        return weights
