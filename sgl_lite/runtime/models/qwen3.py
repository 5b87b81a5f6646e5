"""Qwen3 (dense): the Llama decoder with an RMSNorm over head_dim on each query and key head.

transformers' Qwen3Attention normalizes q and k per head right after their projections and before
RoPE (`q_norm`, `k_norm`, the config's rms_norm_eps); the rest is Llama's layer: no q/k/v bias unless
config.attention_bias, head_dim as the config gives it (it may differ from hidden_size / heads).
The fused decode layer (kernels/csrc/layer/decode_layer.cpp) has no q/k norms, so Qwen3 layers always run
op by op. Under tensor parallelism the two norms stay whole on every rank: they act within one head.
"""

from __future__ import annotations

import torch

from sgl_lite.runtime.layers.layernorm import RMSNorm
from sgl_lite.runtime.layers.rotary_embedding import apply_rope
from sgl_lite.runtime.models.llama import LlamaForCausalLM
from sgl_lite.runtime.models.llama_layer import LlamaDecoderLayer


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_id: int, dtype: torch.dtype, device: torch.device, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__(config, layer_id, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)

    def rotated_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k of the qkv matmul's output, each head RMS-normed over head_dim, then RoPE applied."""
        n, d = qkv.shape[0], self.head_dim
        q = self.q_norm(qkv[:, : self.q_size].reshape(n * self.num_heads, d))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(n * self.num_kv_heads, d))
        return apply_rope(q.view(n, self.num_heads, d), cos, sin), apply_rope(k.view(n, self.num_kv_heads, d), cos, sin)

    def fused_decode_weights(self, rows: int) -> None:
        """Never: the fused decode layer would skip the q/k norms."""
        return None


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
    plain_weights = {
        **LlamaForCausalLM.plain_weights,
        "self_attn.q_norm.weight": "q_norm.weight",
        "self_attn.k_norm.weight": "k_norm.weight",
    }
