"""Tiny random Llama-family checkpoints, written as ordinary HF folders (config, safetensors, tokenizer).

They exercise the same loader, model and runtime code as real weights, in seconds and without any
download. The tokenizer is a byte-level BPE trained on a small built-in text, with ChatML special
tokens and a ChatML chat template, so chat templating, EOS and detokenization all behave as with a
real model.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
What is the capital of France? Paris is the capital of France. Berlin is the capital of Germany.
Thought: I should call a tool. Action: search[weather in Paris] Observation: It is sunny, 21 degrees.
def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2024
{"name": "Alice", "age": 30, "tags": ["x", "y"], "ok": true, "score": 3.5, "none": null}
You are a helpful assistant. Answer the question step by step, then give the final answer.
Unicode: café naïve résumé 東京 Привет — “quotes” 🙂
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(vocab_size: int = 384):
    """A PreTrainedTokenizerFast with byte-level BPE, ChatML tokens and template (EOS = <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    rope_scaling: dict | None = None,
    head_dim: int | None = None,
) -> Path:
    """Write a tiny random model of `arch` ("llama", "qwen2" or "qwen3") to `path` and return the path.

    The weights are drawn with a large std so that greedy logits have clear winners (no near-ties
    that would make fp32 comparisons against transformers flaky). `head_dim` defaults to
    hidden_size / num_heads. Biases and Qwen3's q/k norm weights are random too (transformers
    starts them at 0 and 1), so a model that skipped them would not match.
    """
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        head_dim=head_dim or hidden_size // num_heads,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; expected 'llama', 'qwen2' or 'qwen3'")
    if rope_scaling is not None:
        config.rope_scaling = rope_scaling
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "sgl_lite_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return path
