"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2; Qwen3 in qwen3.py) in plain torch over a paged KV pool;
its layer is llama_layer.py's.

Projections are fused: one QKV matmul and one gate-up matmul per layer, their weights concatenated
at load time from the checkpoint's separate q/k/v and gate/up tensors. Attention is delegated to an
AttentionBackend, which owns the KV writes. `forward` returns final-normed hidden states for every
new token; `compute_logits` runs the LM head only on the rows that are sampled or scored.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sgl_lite.runtime.layers.attention.base import AttentionBackend
from sgl_lite.runtime.layers.layernorm import RMSNorm
from sgl_lite.runtime.layers.linear import (
    GemvLinear,
    QuantizedLinear,
    cpu_packed_linear_supported,
    dense_forms,
    linear,
    quantize_linear,
    reads_dense_weight,
)
from sgl_lite.runtime.layers.quantization import KEEPS_NO_DENSE_WEIGHTS
from sgl_lite.runtime.layers.quantization.w8a8 import W8A16Int8
from sgl_lite.runtime.layers.quantization.weight_only import Int4Values
from sgl_lite.runtime.layers.rotary_embedding import rope_inv_freq, rope_parameters
from sgl_lite.runtime.mem_cache.memory_pool import FP8_KV_DTYPES, KVPool
from sgl_lite.runtime.models.llama_layer import LlamaDecoderLayer, param

logger = logging.getLogger(__name__)


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {  # HF name suffix -> (fused parameter, part index among its parts)
    "self_attn.q_proj": ("qkv", 0),
    "self_attn.k_proj": ("qkv", 1),
    "self_attn.v_proj": ("qkv", 2),
    "mlp.gate_proj": ("gate_up", 0),
    "mlp.up_proj": ("gate_up", 1),
}
_HF_PARTS = {  # fused parameter -> the HF modules it is made of, in order
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
_PLAIN = {
    "self_attn.o_proj.weight": "o_weight",
    "self_attn.o_proj.bias": "o_bias",
    "mlp.down_proj.weight": "down_weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}


class LlamaForCausalLM(nn.Module):
    qkv_bias_default = False
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer
    plain_weights: dict[str, str] = _PLAIN  # HF name suffix in a layer -> its parameter, copied as is

    def __init__(self, config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", max_positions: int | None = None) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = self.qkv_bias_default or attention_bias
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = param((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, dtype, device, qkv_bias=qkv_bias, o_bias=attention_bias)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = self.embed_tokens if self.tie_word_embeddings else param((config.vocab_size, config.hidden_size), dtype, device)
        self.packed_lm_head: torch.Tensor | QuantizedLinear | None = None
        layer0 = self.layers[0]
        self.num_heads, self.num_kv_heads, self.head_dim = layer0.num_heads, layer0.num_kv_heads, layer0.head_dim
        max_positions = max_positions or config.max_position_embeddings
        inv_freq = rope_inv_freq(self.head_dim, rope_parameters(config))
        # float32 angles and cos/sin like transformers, cast once to the model dtype.
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", angles.cos().to(dtype).to(device), persistent=False)
        self.register_buffer("sin_cache", angles.sin().to(dtype).to(device), persistent=False)
        window = getattr(config, "sliding_window", None)
        if window is not None and getattr(config, "use_sliding_window", True) and window < max_positions:
            logger.warning("config has sliding_window=%d; sgl_lite attends over the full context", window)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, kv_pool: KVPool,
                after_layer: Callable[[], object] | None = None, prefill: bool = False) -> torch.Tensor:
        """input_ids, positions [N] -> final-normed hidden states [N, hidden]. `after_layer`, when given, is
        called after every decoder layer (the thread governor's look at a forward in progress); `prefill`:
        some rows are a prompt's (AttentionMetadata.has_prefill_rows), not decode or verification rows."""
        # Checked here on CPU only: on a GPU reading the max back would stall every step and cannot be
        # captured in a CUDA graph; ModelRunner's AttentionMetadata.build bounds every sequence by the context
        # length, which is this cache's size.
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= self.cos_cache.shape[0]:
            raise ValueError(f"position {int(positions.max())} is beyond the RoPE cache ({self.cos_cache.shape[0]} positions)")
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        residual = None
        # the fused decode layer stores into a pool of the model's dtype or of 8-bit floats
        fused = kv_pool.dtype == hidden.dtype or kv_pool.dtype in FP8_KV_DTYPES.values()
        kernel = attn.decode_kernel_inputs(kv_pool) if fused else None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, attn, kv_pool, kernel, prefill)
            if after_layer is not None:
                after_layer()
        return self.norm(hidden, residual)[0] if residual is not None else self.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab] float32."""
        return linear(hidden_rows, self.lm_head, None, self.packed_lm_head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; fuses q/k/v and gate/up. Raises ValueError naming missing/unexpected/misshaped tensors."""
        fused_parts: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            target = self._plain_target(name)
            if target is not None:
                self._copy(target, name, tensor)
                loaded.add(target)
                continue
            m = _LAYER_NAME.match(name)
            key = None
            if m and int(m.group(1)) < len(self.layers):
                proj, _, kind = m.group(2).rpartition(".")
                if proj in _FUSED and kind in ("weight", "bias"):
                    fused, part = _FUSED[proj]
                    key = (int(m.group(1)), fused, kind)
                    fused_parts.setdefault(key, {})[part] = tensor
            if key is None:
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.tie_word_embeddings):
                    continue  # derived from the config / tied to the embeddings
                unexpected.append(name)
        for (layer_id, fused, kind), parts in fused_parts.items():
            target = f"layers.{layer_id}.{fused}_{kind}"
            count = 3 if fused == "qkv" else 2
            if len(parts) != count:
                continue  # reported as missing below
            self._copy(target, f"model.layers.{layer_id}.{fused} parts", torch.cat([parts[i] for i in range(count)], 0))
            loaded.add(target)
        if unexpected:
            raise ValueError(f"unexpected weight(s) for {type(self).__name__}: {', '.join(sorted(unexpected)[:10])}")
        expected = {n for n, p in self.named_parameters() if p is not None}
        if self.tie_word_embeddings:
            expected.discard("lm_head")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"missing weight(s) for {type(self).__name__}: {', '.join(missing[:10])}")

    def pack_weights(self, batch_hint: int = 32, quantization: str | None = None,
                     int4_values: dict[str, Int4Values] | None = None, batch_invariant: bool = False,
                     drop_unread: bool = True) -> bool:
        """After loading: pack the matmul weights for the kernels that take their calls (layers/linear.py):
        the small-row kernel's layout where one serves them, and oneDNN's (bf16 on CPU) for the calls above
        its row limit (none where it takes every call); with `quantization` (one of
        layers.quantization.QUANTIZATION_METHODS) add the quantized forms: weight-only ones for calls of few
        rows, w8a8_int8 for every call. `int4_values`: HF weight name -> a GGUF file's own 4-bit blocks, used
        instead of quantizing those weights (they must dequantize to the loaded ones). `batch_invariant`
        (--enable-deterministic-inference): no form whose rows depend on the call's row count. `drop_unread`:
        free the loaded weights the packed forms make unread (_drop_unread_weights).

        The packed copies are what forward() uses from then on, so call it only once the weights are
        final. Each packed form is one more copy of the matmul weights in memory. Returns whether oneDNN
        packing is available here.
        """
        packed = cpu_packed_linear_supported(self.dtype, self.embed_tokens.device)

        def forms(weight: torch.Tensor) -> torch.Tensor | GemvLinear | None:
            # None under w8a8_int8 and w4a8_int4, whose quantized forms take every call and keep no dense one
            # (~0.3 s and a copy of the weights packed at load only to be dropped).
            return None if quantization in KEEPS_NO_DENSE_WEIGHTS else dense_forms(weight, packed, batch_hint, batch_invariant)

        try:
            for layer in self.layers:
                layer.packed = {name: forms(getattr(layer, f"{name}_weight")) for name in layer.packed}
            self.packed_lm_head = forms(self.lm_head)
        except RuntimeError as e:  # an oneDNN build without bf16 support: stay on F.linear
            logger.warning("oneDNN weight packing unavailable (%s); using F.linear", e)
            packed = False
            for layer in self.layers:
                layer.packed = {name: forms(getattr(layer, f"{name}_weight")) for name in layer.packed}
            self.packed_lm_head = forms(self.lm_head)
        if quantization is not None:
            self._quantize(quantization, int4_values or {})
        if drop_unread:
            self._drop_unread_weights()
        return packed

    def _drop_unread_weights(self) -> None:
        """Free each layer matmul weight no call reads any more (its packed forms take every call): a copy of
        the weights' bytes, given back to the KV pool's budget. What is left is a meta tensor of its shape, so
        a call that did reach it fails instead of reading garbage."""
        for layer in self.layers:
            for name, form in layer.packed.items():
                weight = getattr(layer, f"{name}_weight")
                if not reads_dense_weight(form):
                    setattr(layer, f"{name}_weight", param(tuple(weight.shape), weight.dtype, torch.device("meta")))

    def _quantize(self, method: str, int4_values: dict[str, Int4Values]) -> None:
        for layer in self.layers:
            prefix = f"model.layers.{layer.layer_id}."
            for name in layer.packed:
                weight = getattr(layer, f"{name}_weight")
                parts = [int4_values.get(prefix + hf + ".weight") for hf in _HF_PARTS[name]]
                values = Int4Values.cat(parts) if all(p is not None for p in parts) else None
                _check_same_weight(values, weight, f"{prefix}{name}")
                layer.packed[name] = quantize_linear(method, weight.detach(), layer.packed[name], values)
            layer._decode_operands = None  # its packed dict changed in place
        if method in KEEPS_NO_DENSE_WEIGHTS:
            # Logits decide every token: SGLang's w8a8_int8 checkpoints keep the LM head dense (llama.cpp's Q4_0
            # files keep it at 6 bits). Its int8 weights with 16-bit activations stay within the weights' own
            # rounding at half the bf16 head's bytes.
            self.packed_lm_head = QuantizedLinear(W8A16Int8(self.lm_head.detach()), None, None)
            return
        head = int4_values.get("model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight")
        _check_same_weight(head, self.lm_head, "lm_head")
        self.packed_lm_head = quantize_linear(method, self.lm_head.detach(), self.packed_lm_head, head)

    def _plain_target(self, name: str) -> str | None:
        if name == "model.embed_tokens.weight":
            return "embed_tokens"
        if name == "model.norm.weight":
            return "norm.weight"
        if name == "lm_head.weight" and not self.tie_word_embeddings:
            return "lm_head"
        m = _LAYER_NAME.match(name)
        if m and int(m.group(1)) < len(self.layers) and m.group(2) in self.plain_weights:
            return f"layers.{m.group(1)}.{self.plain_weights[m.group(2)]}"
        return None

    def _copy(self, target: str, source: str, tensor: torch.Tensor) -> None:
        try:
            param = self.get_parameter(target)
        except AttributeError:
            raise ValueError(f"weight {source} is not used by this config (no {target})") from None
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {source} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)


def _check_same_weight(values: Int4Values | None, weight: torch.Tensor, name: str) -> None:
    """A GGUF file's blocks must be the weights the model loaded (its dequantized copy): else the cache
    and the file disagree, and serving would silently mix two models."""
    if values is None:
        return
    dense = weight.detach().float()
    if values.q.shape != dense.shape:
        raise ValueError(f"GGUF 4-bit weight for {name} has shape {tuple(values.q.shape)}, expected {tuple(dense.shape)}")
    error = (values.dequantize().to(weight.dtype).float() - dense).abs().max().item()
    if error > 1e-2 * max(dense.abs().max().item(), 1e-6):
        raise ValueError(f"GGUF 4-bit weight for {name} differs from the loaded weight (max error {error:.3g})")


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True
