"""`sgl-lite demo`: answer one chat question on the default model, in-process, with timings."""

from __future__ import annotations

import time

import click

DEMO_QUESTION = "What is the capital of France? Answer in one sentence."


def run_demo(model_path: str = "smollm2-135m") -> None:
    from sgl_lite.runtime.engine import Engine

    started = time.perf_counter()
    with Engine(model_path=model_path) as engine:
        loaded = time.perf_counter()
        click.echo(f"loaded {model_path} in {loaded - started:.1f} s")
        messages = [{"role": "user", "content": DEMO_QUESTION}]
        prompt = engine.core.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        result = engine.generate(prompt, {"max_new_tokens": 64, "temperature": 0.0})
        elapsed = time.perf_counter() - loaded
        tokens = result["meta_info"]["completion_tokens"]
        click.echo(f"user: {DEMO_QUESTION}")
        click.echo(f"assistant: {result['text'].strip()}")
        click.echo(f"{tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tokens/s)")
