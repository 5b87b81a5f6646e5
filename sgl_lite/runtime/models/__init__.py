"""Model classes by HF architecture name (config.architectures[0])."""

from __future__ import annotations

import torch

from sgl_lite.runtime.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from sgl_lite.runtime.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(config) -> type[LlamaForCausalLM]:
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError("config.architectures is empty; cannot pick a model class")
    cls = MODEL_REGISTRY.get(archs[0])
    if cls is None:
        raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return cls


def build_model(config, dtype: torch.dtype, device: str | torch.device, max_positions: int | None = None) -> LlamaForCausalLM:
    return model_class(config)(config, dtype=dtype, device=device, max_positions=max_positions)


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "build_model", "model_class"]
