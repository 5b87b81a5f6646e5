"""transformers' own greedy output: the reference every model-path correctness test compares against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_model(model_dir: str | Path) -> Any:
    """The folder's model in transformers, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model: Any, ids: list[int], num_new: int, eos_token_id: int | None = None) -> list[int]:
    """The ids transformers' `generate` picks greedily after `ids`: exactly `num_new` of them when
    `eos_token_id` is None (EOS ignored, as the runtime's ignore_eos), else up to and including EOS."""
    stop = {"min_new_tokens": num_new} if eos_token_id is None else {}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=num_new, do_sample=False, eos_token_id=eos_token_id,
                             pad_token_id=0 if eos_token_id is None else eos_token_id, **stop)
    return out[0, len(ids):].tolist()
