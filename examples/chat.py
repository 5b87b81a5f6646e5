"""A multi-turn chat: roles follow the model's own chat template; later turns reuse the cache.

    python examples/chat.py [--model-path smollm2-135m]
"""

from __future__ import annotations

import argparse

import sgl_lite as sgl


@sgl.function
def chat(s, questions):
    s += sgl.system("You are a helpful assistant. Answer in one or two sentences.")
    for i, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=64))


def main() -> None:
    parser = argparse.ArgumentParser(description="multi-turn chat with the sgl_lite DSL")
    parser.add_argument("--model-path", default="smollm2-135m")
    args = parser.parse_args()
    questions = ["What is the capital of France?", "What is it famous for?", "Name one museum there."]
    with sgl.Runtime(model_path=args.model_path) as runtime:
        sgl.set_default_backend(runtime)
        state = chat.run(questions, temperature=0)
        for i, question in enumerate(questions):
            meta = state.get_meta_info(f"answer_{i}")
            print(f"user: {question}")
            print(f"assistant: {state[f'answer_{i}'].strip()}")
            print(f"  (prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from cache)")
        if state.error() is not None:
            raise SystemExit(f"program failed: {state.error()!r}")


if __name__ == "__main__":
    main()
