"""Per-step cost of grammar masking: fill the bitmask of `batch` constrained requests and apply it to
[batch, vocab] float32 logits, as the sampler does once per decode step.

Every request follows a JSON schema (with length-bounded strings, then with free ones) and advances by a random allowed token each
step (restarting when it terminates), so the matchers visit varied states rather than the start state.

    PYTHONPATH=. python scripts/bench_grammar.py [--batch 32] [--steps 200] [--out artifacts/bench_grammar.json]

It also times an unconstrained decode step of the default model at the same batch size in the same
run (scripts/runner_bench.py's RunnerBench) and prints the mask cost as a fraction of that step.

Uses the default model's tokenizer (SmolLM2, vocab 49152) when the loader can provide it, else the
tiny test tokenizer (vocab ~400, far cheaper: not representative).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import xgrammar

from sgl_lite.bench.artifacts import output_file
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.grammar import GrammarBackend, apply_grammar_masks

BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "tags"],
}
# The same shape with unbounded strings: xgrammar precomputes their masks, while a maxLength string
# makes every step inside it re-check most of the vocabulary (costly per row on a 49k vocabulary).
BENCH_SCHEMA_FREE_STRINGS = {
    **BENCH_SCHEMA,
    "properties": {
        **BENCH_SCHEMA["properties"],
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
}


def default_tokenizer() -> tuple[Any, int, str]:
    """(tokenizer, model vocab size, name): SmolLM2 via the loader if available, else the tiny one."""
    try:
        from sgl_lite.runtime.model_executor import loader

        folder = loader.resolve_model_path("smollm2-135m")
        return loader.load_tokenizer(folder), loader.load_config(folder).vocab_size, "smollm2-135m"
    except Exception:  # loader missing or model unavailable: fall back to the tiny tokenizer
        from sgl_lite.testing.tiny_model import build_tokenizer

        tokenizer = build_tokenizer()
        return tokenizer, len(tokenizer), "tiny"


def mask_cost_per_step(
    batch: int = 32,
    steps: int = 200,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    schema: dict = BENCH_SCHEMA,
) -> dict:
    """Mean milliseconds per step to fill the bitmask of `batch` constrained rows and apply it."""
    name = "given"
    if tokenizer is None:
        tokenizer, vocab_size, name = default_tokenizer()
    vocab_size = vocab_size or len(tokenizer)
    backend = GrammarBackend(tokenizer, vocab_size, eos_token_ids=[tokenizer.eos_token_id])
    params = SamplingParams(json_schema=schema)
    matchers = [backend.request_matcher(params).result(timeout=120) for _ in range(batch)]
    generator = torch.Generator().manual_seed(0)
    bitmask = xgrammar.allocate_token_bitmask(batch, vocab_size)
    rows = list(range(batch))
    fill_s = apply_s = 0.0
    for _ in range(steps):
        logits = torch.randn(batch, vocab_size, generator=generator)
        # The two halves of apply_grammar_masks, timed apart.
        start = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
        fill_s += time.perf_counter() - start
        start = time.perf_counter()
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
        apply_s += time.perf_counter() - start
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).flatten().tolist()
        for matcher, token in zip(matchers, tokens):
            matcher.accept_token(token)
            if matcher.is_terminated():
                matcher.reset()
    # The real entry point once more, so the benchmark fails loudly if it diverges from the halves above.
    apply_grammar_masks(torch.randn(batch, vocab_size, generator=generator), matchers)
    backend.shutdown()
    fill_ms = fill_s / steps * 1e3
    apply_ms = apply_s / steps * 1e3
    return {
        "tokenizer": name,
        "vocab_size": vocab_size,
        "batch": batch,
        "steps": steps,
        "total_ms": fill_ms + apply_ms,  # what the sampler pays per step
        "fill_ms": fill_ms,
        "apply_ms": apply_ms,
    }


def decode_step_ms(batch: int, steps: int = 8) -> float:
    """Milliseconds per decode step of the default model at `batch` (128-token prompts), best of 2."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from runner_bench import RunnerBench

    from sgl_lite.runtime.model_executor.loader import resolve_model_path
    from sgl_lite.runtime.model_executor.model_runner import ModelRunner
    from sgl_lite.runtime.server_args import ServerArgs

    model_dir = resolve_model_path("smollm2-135m")
    runner = ModelRunner(ServerArgs(model_path=str(model_dir), max_total_tokens=batch * (128 + 3 * steps) + 64,
                                    max_running_requests=batch + 1), model_dir=model_dir)
    prompts = torch.randint(3, runner.vocab_size, (batch, 128), generator=torch.Generator().manual_seed(0)).tolist()
    tokens_per_s = RunnerBench(runner).decode(prompts, steps=steps, repeats=2)
    return batch / tokens_per_s * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    results = {}
    for name, schema in (("bounded_strings", BENCH_SCHEMA), ("free_strings", BENCH_SCHEMA_FREE_STRINGS)):
        result = results[name] = mask_cost_per_step(batch=args.batch, steps=args.steps, schema=schema)
        print(
            f"grammar mask ({name}), {result['batch']} constrained rows, vocab {result['vocab_size']} "
            f"({result['tokenizer']}): {result['total_ms']:.3f} ms/step "
            f"(fill {result['fill_ms']:.3f} + apply {result['apply_ms']:.3f})"
        )
    step_ms = decode_step_ms(args.batch)
    results["decode_step_ms"] = step_ms
    for name in ("bounded_strings", "free_strings"):
        share = results[name]["total_ms"] / (step_ms + results[name]["total_ms"])
        results[name]["fraction_of_step"] = share
        print(f"{name}: mask {results[name]['total_ms']:.2f} ms + model step {step_ms:.2f} ms at batch {args.batch} "
              f"-> the mask is {share:.0%} of a constrained decode step")
    if args.out:
        with open(output_file(args.out), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
