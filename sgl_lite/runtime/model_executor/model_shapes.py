"""Random-weight Llama models of realistic sizes, written once as ordinary HF folders with a real tokenizer.

Benchmarks at sizes the default model does not reach (and device checks on machines that cannot fetch it)
need a model of the right shape, not of the right knowledge: outputs are noise, timings are real. Each
shape copies the tokenizer (and chat template) of a given model folder, so prompts tokenize as they would
for the real model; the weights are transformers' own initialization, seeded, in the dtype asked for.

    python -m sgl_lite.runtime.model_executor.model_shapes --shape 1.7b --tokenizer-dir ~/.cache/sgl_lite/models/smollm2-135m-0.1.2
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

# SmolLM2's family (135M is the default model's own shape) and a Llama 3.2 3B-like shape.
SHAPES: dict[str, dict[str, int | bool]] = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 tie_word_embeddings=True),
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                 tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                 tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def parameter_count(shape: str, vocab_size: int = 49152) -> int:
    s = SHAPES[shape]
    hidden, inter, layers = int(s["hidden_size"]), int(s["intermediate_size"]), int(s["num_hidden_layers"])
    head_dim = hidden // int(s["num_attention_heads"])
    attention = hidden * head_dim * (2 * int(s["num_attention_heads"]) + 2 * int(s["num_key_value_heads"]))
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + vocab_size * hidden * (1 if s["tie_word_embeddings"] else 2) + hidden


def random_model_dir(shape: str, tokenizer_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """The folder of a random `shape` model (written unless a complete one is there already)."""
    import torch
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; expected one of {', '.join(SHAPES)}")
    out = Path(out_dir)
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    source = Path(tokenizer_dir)
    config = json.loads((source / "config.json").read_text())
    config.update(SHAPES[shape], head_dim=int(SHAPES[shape]["hidden_size"]) // int(SHAPES[shape]["num_attention_heads"]),
                  architectures=["LlamaForCausalLM"], model_type="llama", dtype=dtype)
    config.pop("torch_dtype", None)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(getattr(torch, dtype))
    model.save_pretrained(staging, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, staging / name)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)  # a folder is complete or absent, never half-written
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer-dir", required=True, help="a model folder whose config.json and tokenizer files to use")
    parser.add_argument("--out", help="where to write it (default: random-<shape> beside the tokenizer folder)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    out = args.out or Path(args.tokenizer_dir).expanduser().parent / f"random-{args.shape}"
    print(random_model_dir(args.shape, Path(args.tokenizer_dir).expanduser(), out, args.dtype))


if __name__ == "__main__":
    main()
