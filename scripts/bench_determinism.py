"""How often a greedy answer changes once its prompt is cached, with and without --enable-deterministic-inference.

For each mode: an Engine on the model (default: SmolLM2-135M-Instruct, --dtype auto), N chat prompts
(generated from templates, so no data set is needed) answered greedily as one batch from a flushed
cache ("cold"), then again as one batch with every prompt in the radix cache ("cached"). Reports the
share of prompts whose answers differ, and each mode's wall time (noisy on a shared machine).

    python scripts/bench_determinism.py --num-prompts 200 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from sgl_lite.runtime.server.engine import Engine

SUBJECTS = ["France", "Japan", "Brazil", "Canada", "Egypt", "Italy", "Kenya", "Norway", "Peru", "India"]
QUESTIONS = ["What is the capital of {}?", "Name a famous dish from {}.", "What language is spoken in {}?",
             "Describe the climate of {} in one sentence.", "Name a river in {}.",
             "What currency does {} use?", "Give one fact about the history of {}.",
             "What is a popular sport in {}?", "Name a city in {} other than its capital.",
             "What continent is {} on?", "Suggest a tourist attraction in {}.",
             "What is {} known for?", "Who is a famous person from {}?",
             "What is the population of {} roughly?", "Write a haiku about {}.",
             "What animals live in {}?", "Name a festival celebrated in {}.",
             "What is the flag of {} like?", "How would you greet someone in {}?",
             "What mountains are in {}?"]


def prompts(tokenizer, n: int) -> list[str]:
    texts = [q.format(s) for q, s in itertools.product(QUESTIONS, SUBJECTS)][:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts]


def run(model_path: str, deterministic: bool, n: int, max_new_tokens: int) -> dict:
    engine = Engine(model_path=model_path, enable_deterministic_inference=deterministic, log_level="warning")
    try:
        texts = prompts(engine.core.tokenizer, n)
        params = {"max_new_tokens": max_new_tokens, "temperature": 0}
        engine.flush_cache()
        started = time.perf_counter()
        cold = engine.generate(texts, params)
        cold_s = time.perf_counter() - started
        started = time.perf_counter()
        cached = engine.generate(texts, params)
        cached_s = time.perf_counter() - started
        differ = sum(a["output_ids"] != b["output_ids"] for a, b in zip(cold, cached))
        hit = sum(o["meta_info"]["cached_tokens"] for o in cached) / sum(o["meta_info"]["prompt_tokens"] for o in cached)
        return {"deterministic": deterministic, "dtype": str(engine.core.runner.dtype), "prompts": len(texts),
                "differ": differ, "differ_share": differ / len(texts), "cached_pass_hit_rate": round(hit, 3),
                "cold_s": round(cold_s, 1), "cached_s": round(cached_s, 1)}
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    for deterministic in (False, True):
        print(json.dumps(run(args.model_path, deterministic, args.num_prompts, args.max_new_tokens)), flush=True)


if __name__ == "__main__":
    main()
