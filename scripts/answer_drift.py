"""How often a model's chat answers tokenize to other ids than it generated them as.

An agent sends each answer back as an assistant message; the server tokenizes its text again, and where
that splits it otherwise ("\\n\\n" as one token where the model wrote two) the prefix cache misses from there
on, unless the server keeps the generated ids (`--reuse-answer-ids`, docs/http.md). This measures the share
of such answers: chat prompts (one user message each) answered by the model in-process (sgl_lite's Engine),
greedy and sampled, each answer's ids (its control tokens left out) against its decoded text tokenized again.

Prints a table, writes JSON. Usage:
    python scripts/answer_drift.py [--model-path smollm2-135m] [--temperatures 0,0.7,1.0] [--max-new-tokens 128]
        [--repeats 3] [--out artifacts/answer_drift.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TASKS = [
    "Explain how a hash map works.", "Write a Python function that reverses a linked list.",
    "What is the capital of Australia and why?", "List three uses of the ls command.", "Summarize the plot of Hamlet.",
    "How do I read a CSV file in pandas?", "What is 17 * 23? Show steps.", "Write a haiku about autumn.",
    "Give me a JSON object describing a cat.", "Explain TCP vs UDP.",
    "Translate 'good morning' into French, Spanish and German.", "Write a bash loop over files.",
    "What is recursion?", "Describe the water cycle.", "How do I make a git branch?",
    "Write SQL to count rows per user.", "Explain the difference between a list and a tuple.",
    "What's a good name for a bakery?", "Give tips for a job interview.", "Explain photosynthesis briefly.",
    "Write a regex matching email addresses.", "What does HTTP 404 mean?", "Explain big-O notation.",
    "Plan a 3-day trip to Rome.", "How do vaccines work?", "Write a C function computing factorial.",
    'Call the weather tool. Answer in JSON: {"tool": ..., "args": ...}', "Describe a neural network in two sentences.",
    "How to center a div in CSS?", "Tell me a joke.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="smollm2-135m")
    parser.add_argument("--temperatures", default="0,0.7,1.0", help="comma-separated; 0 is greedy")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="each task this many times per temperature (seeds)")
    parser.add_argument("--out", default="artifacts/answer_drift.json")
    args = parser.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.max_new_tokens < 1 or args.repeats < 1 or any(t < 0 for t in temperatures):
        parser.error("--max-new-tokens and --repeats must be positive, temperatures non-negative")

    from sgl_lite.runtime.model_executor.loader import load_tokenizer, resolve_model_path
    from sgl_lite.runtime.server.engine import Engine

    engine = Engine(model_path=args.model_path)
    tokenizer = load_tokenizer(resolve_model_path(args.model_path))
    specials = set(tokenizer.all_special_ids)
    prompts = []
    for task in TASKS * args.repeats:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": task}], tokenize=True, add_generation_prompt=True)
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    rows = []
    for temperature in temperatures:
        params = [{"max_new_tokens": args.max_new_tokens, "temperature": temperature, "seed": i}
                  for i in range(len(prompts))]
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        drifted, first = 0, []
        for output in outputs:
            ids = [i for i in output["output_ids"] if i not in specials]
            again = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
            if again != ids:
                drifted += 1
                first.append(next((k for k, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again))))
        rows.append({"temperature": temperature, "answers": len(outputs), "tokenized_otherwise": drifted,
                     "mean_answer_tokens": sum(len(o["output_ids"]) for o in outputs) / len(outputs),
                     "first_difference_mean": sum(first) / len(first) if first else None})
    engine.shutdown()
    print(f"\n{args.model_path}, chat answers of up to {args.max_new_tokens} tokens\n")
    print("| temperature | answers | tokenized to other ids | share | mean answer tokens | first differing token (mean) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        where = "-" if r["first_difference_mean"] is None else f"{r['first_difference_mean']:.0f}"
        print(f"| {r['temperature']:g} | {r['answers']} | {r['tokenized_otherwise']} | "
              f"{r['tokenized_otherwise'] / r['answers']:.0%} | {r['mean_answer_tokens']:.0f} | {where} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model_path": args.model_path, "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
