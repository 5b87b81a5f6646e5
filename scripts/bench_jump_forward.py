"""Jump-forward decoding on and off, in one run: forwards per request, output tok/s and latency per workload,
and the grammar's own cost per decode step against the forward.

Workloads (greedy, chat-templated prompts on the default model, in-process Engine, the same requests on both
systems, the systems alternating per measurement and each reporting its fastest of --repeats):
- json: extraction into a key-heavy JSON schema (nested objects, several fixed keys, enums, booleans);
- tools: one call of one of two tools with tool_choice="required" (the HTTP front's structural tag, Qwen 2.5 format);
- regex: a form filled through a regex (fixed labels, a date, an enum, an amount);
- plain: the json prompts without a constraint (jump-forward has nothing to do: its cost, if any).
"Forwards per request" counts the forwards a request took part in: its prefill and each decode step
(every output token was sampled in one, except the ones a jump wrote). Outputs are checked valid, and
compared between the systems (equal texts; where they differ, the retokenized tokens at a jump differed
from the model's own, tests/test_jump_forward_greedy.py).

Then, per decode step at batch 1, 8 and 32 on the json schema: the scheduler thread's grammar work (fill
the bitmask, apply it to the logits, look for a jump) against a decode forward of the default model.

Each workload runs at each --concurrency (requests in flight at once; 1: one after another). With several
in flight, a step in which any request jumps is an extend forward for the whole batch (its decode rows
included), which on a CPU costs more than a decode step that runs the fused decode kernels; the table
shows what that leaves of the fewer forwards. Timings on a shared box move with its load: the CPU-time
column (this process's CPU seconds, all threads) moves less.

Usage: python scripts/bench_jump_forward.py [--requests 4] [--concurrency 1 4] [--repeats 1] [--batches 1 8 32]
       [--out artifacts/bench_jump_forward.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jsonschema  # noqa: E402
import torch  # noqa: E402
import xgrammar  # noqa: E402
from bench_grammar import decode_step_ms  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, save_png  # noqa: E402
from sgl_lite.http.openai_api.tool_parsers import PARSERS  # noqa: E402
from sgl_lite.http.openai_api.tools import ToolRequest  # noqa: E402
from sgl_lite.runtime.protocol import SamplingParams  # noqa: E402
from sgl_lite.runtime.sampling.grammar import GrammarBackend  # noqa: E402
from sgl_lite.runtime.server.engine import Engine  # noqa: E402

EXTRACT_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24}, "tier": {"enum": ["free", "pro", "enterprise"]},
            "country": {"enum": ["US", "FR", "DE", "JP", "BR"]}}, "required": ["name", "tier", "country"]},
        "order": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999999}, "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "express": {"type": "boolean"}, "items": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["id", "status", "express", "items"]},
        "category": {"enum": ["billing", "shipping", "product", "account"]},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "needs_followup": {"type": "boolean"},
    },
    "required": ["customer", "order", "category", "sentiment", "needs_followup"],
}
MESSAGES = [
    "Hi, I'm Maria Lopez (pro plan, France). Order 48213 with 3 items still says pending and I paid for express!",
    "This is Kenji Sato from Japan, enterprise account. Order 9921, 12 items, arrived yesterday. Great service.",
    "Tom Becker, free tier, Germany. My order 5530 (1 item) was cancelled and I was charged anyway.",
    "Ana Souza here, Brazil, pro. Order 77102 shipped with 4 items, standard delivery. Where is the tracking link?",
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "book_table", "description": "Book a restaurant table.", "parameters": {
        "type": "object", "properties": {"restaurant": {"type": "string", "maxLength": 24}, "guests": {"type": "integer", "minimum": 1, "maximum": 20},
                                         "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}, "required": ["restaurant", "guests", "time"]}}},
]
TOOL_QUESTIONS = ["What's the weather in Lyon right now, in celsius?", "Book a table for 4 at Chez Marcel at 19:30.",
                  "Is it cold in Boston today? Answer in fahrenheit.", "Reserve Sakura Sushi for 2 people at 20:00."]
FORM_REGEX = (r"Name: [A-Z][a-z]{1,12} [A-Z][a-z]{1,12}\nDate: 20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])\n"
              r"Decision: (approved|rejected|pending review)\nAmount: \$[0-9]{1,5}\.[0-9]{2}\n")
FORM_REQUESTS = ["Fill the expense form: Paul Martin spent $120.50 on 2024-05-14, approved.",
                 "Fill the expense form: Julia Weber, 2023-11-02, $89.99, still pending review.",
                 "Fill the expense form: Omar Haddad claimed $1500.00 on 2024-01-30; rejected.",
                 "Fill the expense form: Lena Novak, $42.10, 2024-07-08, approved."]


def tool_tag() -> str:
    return json.dumps(ToolRequest(TOOLS, "required", None, False, PARSERS["qwen25"], True).structural_tag())


def valid_tool_text(text: str) -> bool:
    calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        parsed = json.loads(call)
        jsonschema.validate(parsed["arguments"], schemas[parsed["name"]])
    return bool(calls)


def valid_json(text: str) -> bool:
    jsonschema.validate(json.loads(text), EXTRACT_SCHEMA)
    return True


def workloads(tokenizer, n: int, max_new_tokens: int) -> dict[str, tuple[list[list[int]], dict, object]]:
    def chat(system: str, user: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    pick = lambda items: [items[i % len(items)] for i in range(n)]  # noqa: E731
    extract = "Extract the customer's message into JSON with the fields customer, order, category, sentiment, needs_followup."
    tools = "You call tools. Tools: " + json.dumps([t["function"] for t in TOOLS]) + \
        ' Answer with <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.'
    common = {"temperature": 0, "max_new_tokens": max_new_tokens}
    return {
        "json": ([chat(extract, m) for m in pick(MESSAGES)], {**common, "json_schema": json.dumps(EXTRACT_SCHEMA)}, valid_json),
        "tools": ([chat(tools, q) for q in pick(TOOL_QUESTIONS)], {**common, "structural_tag": tool_tag()}, valid_tool_text),
        "regex": ([chat("You fill forms exactly.", f) for f in pick(FORM_REQUESTS)], {**common, "regex": FORM_REGEX},
                  lambda text: re.fullmatch(FORM_REGEX, text) is not None),
        "plain": ([chat(extract, m) for m in pick(MESSAGES)], {**common, "max_new_tokens": 64}, lambda text: True),
    }


def measure(engine: Engine, prompts: list[list[int]], params: dict, concurrency: int, valid) -> dict:
    engine.flush_cache()
    steps = engine.core.scheduler.num_forward_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    outs: list[dict] = []
    for first in range(0, len(prompts), concurrency):
        outs += engine.generate(input_ids=prompts[first : first + concurrency], sampling_params=params)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    metas = [o["meta_info"] for o in outs]
    tokens = sum(m["completion_tokens"] for m in metas)
    jumped = [m.get("jump_forward_tokens", 0) for m in metas]
    oks = []
    for o in outs:
        try:
            oks.append(bool(valid(o["text"])))
        except (ValueError, jsonschema.ValidationError):
            oks.append(False)
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tok_s": tokens / seconds, "output_tokens": tokens,
            "forwards_per_request": statistics.mean(m["completion_tokens"] - j for m, j in zip(metas, jumped)),
            "jump_tokens_per_request": statistics.mean(jumped), "e2e_latency_s": statistics.mean(m["e2e_latency"] for m in metas),
            "forward_steps": engine.core.scheduler.num_forward_steps - steps, "valid": sum(oks) / len(oks),
            "texts": [o["text"] for o in outs]}


def grammar_cost(tokenizer, vocab_size: int, batch: int, steps: int) -> dict:
    """Ms per decode step (median) of the scheduler thread's grammar work for `batch` json requests advancing by
    random allowed tokens: fill the bitmask, apply it to [batch, vocab] logits, and look for a jump in every row."""
    backend = GrammarBackend(tokenizer, vocab_size, eos_token_ids=[tokenizer.eos_token_id])
    matchers = [backend.request_matcher(SamplingParams(json_schema=json.dumps(EXTRACT_SCHEMA))).result(timeout=300) for _ in range(batch)]
    generator = torch.Generator().manual_seed(0)
    bitmask = xgrammar.allocate_token_bitmask(batch, vocab_size)
    fill, apply, jump = [], [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab_size, generator=generator)
        t0 = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
        t1 = time.perf_counter()
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=list(range(batch)))
        t2 = time.perf_counter()
        for matcher in matchers:
            matcher.jump_forward_string()
        t3 = time.perf_counter()
        fill.append(t1 - t0), apply.append(t2 - t1), jump.append(t3 - t2)
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).flatten().tolist()
        for matcher, token in zip(matchers, tokens):
            matcher.accept_token(token)
            if matcher.is_terminated():
                matcher.reset()
    backend.shutdown()
    # Medians: a neighbour taking a core stalls some steps for several times their cost, always upwards.
    return {"fill_ms": 1e3 * statistics.median(fill), "apply_ms": 1e3 * statistics.median(apply),
            "jump_check_ms": 1e3 * statistics.median(jump)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=4, help="requests per workload")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="requests in flight at once")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each cell, the systems alternating; the fastest of each is reported")
    parser.add_argument("--workloads", nargs="+", default=["json", "tools", "regex", "plain"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes of the grammar-cost measurement")
    parser.add_argument("--grammar-steps", type=int, default=100)
    parser.add_argument("--out", default=artifact_path("bench_jump_forward.json"))
    args = parser.parse_args()

    common = dict(model_path=args.model, dtype=args.dtype, max_running_requests=max(args.concurrency), log_level="warning")
    systems = {"off": Engine(**common, disable_regex_jump_forward=True), "on": Engine(**common)}
    tokenizer = systems["on"].core.tokenizer
    data = workloads(tokenizer, args.requests, args.max_new_tokens)
    rows: list[dict] = []
    for name in args.workloads:
        prompts, params, valid = data[name]
        for engine in systems.values():  # the grammar's compile and the first forwards are not measured
            engine.generate(input_ids=prompts[0], sampling_params={**params, "max_new_tokens": 2})
        for concurrency in args.concurrency:
            row: dict = {"workload": name, "concurrency": concurrency}
            for _ in range(args.repeats):  # the systems alternate, so a slow spell of the box hits both
                for system, engine in systems.items():
                    run = measure(engine, prompts, params, concurrency, valid)
                    if system not in row or run["tok_s"] > row[system]["tok_s"]:
                        row[system] = run
            texts_on, texts_off = row["on"].pop("texts"), row["off"].pop("texts")
            row["same_text"] = sum(a == b for a, b in zip(texts_on, texts_off)) / len(texts_on)
            row["example_on"], row["example_off"] = texts_on[0], texts_off[0]
            row["fewer_forwards"] = row["off"]["forwards_per_request"] / row["on"]["forwards_per_request"]
            row["e2e_speedup"] = row["off"]["e2e_latency_s"] / row["on"]["e2e_latency_s"]
            row["cpu_speedup"] = row["off"]["cpu_seconds"] / row["on"]["cpu_seconds"]
            rows.append(row)
            print(f"{name} at concurrency {concurrency}: done", flush=True)
    vocab_size = systems["on"].core.runner.vocab_size
    for engine in systems.values():
        engine.shutdown()

    costs = []
    for batch in args.batches:
        cost = grammar_cost(tokenizer, vocab_size, batch, args.grammar_steps)
        cost["batch"], cost["decode_step_ms"] = batch, decode_step_ms(batch)
        cost["share"] = (cost["fill_ms"] + cost["apply_ms"] + cost["jump_check_ms"]) / cost["decode_step_ms"]
        costs.append(cost)

    print(f"\nload average {os.getloadavg()[0]:.2f}; model {args.model}, greedy, {args.requests} requests per workload, "
          f"max {args.max_new_tokens} new tokens, best of {args.repeats}")
    print("| workload | in flight | forwards/request off -> on | fewer forwards | jumped tokens/request | output tok/s off -> on | "
          "e2e latency s off -> on | e2e speedup | CPU-time speedup | valid off / on | same text |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        off, on = r["off"], r["on"]
        print(f"| {r['workload']} | {r['concurrency']} | {off['forwards_per_request']:.1f} -> {on['forwards_per_request']:.1f} | "
              f"{r['fewer_forwards']:.2f}x | {on['jump_tokens_per_request']:.1f} | {off['tok_s']:.1f} -> {on['tok_s']:.1f} | "
              f"{off['e2e_latency_s']:.2f} -> {on['e2e_latency_s']:.2f} | {r['e2e_speedup']:.2f}x | {r['cpu_speedup']:.2f}x | "
              f"{off['valid']:.0%} / {on['valid']:.0%} | {r['same_text']:.0%} |")
    print("\n| batch | bitmask fill ms | apply ms | jump check ms | decode forward ms | grammar / forward |")
    print("|---|---|---|---|---|---|")
    for c in costs:
        print(f"| {c['batch']} | {c['fill_ms']:.3f} | {c['apply_ms']:.3f} | {c['jump_check_ms']:.3f} | {c['decode_step_ms']:.1f} | {c['share']:.1%} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"args": vars(args), "workloads": rows, "grammar_cost": costs}, indent=2))
    print(f"wrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"{r['workload']}\nc={r['concurrency']}" for r in rows]
    x = range(len(rows))
    left.bar([i - 0.2 for i in x], [r["off"]["forwards_per_request"] for r in rows], width=0.4, label="off")
    left.bar([i + 0.2 for i in x], [r["on"]["forwards_per_request"] for r in rows], width=0.4, label="jump-forward")
    left.set_xticks(list(x), names)
    left.set_ylabel("forwards per request")
    left.legend()
    right.bar(names, [r["e2e_speedup"] for r in rows])
    right.axhline(1.0, color="gray", linestyle="--")
    right.set_ylabel("end-to-end latency, off / on")
    fig.suptitle("Jump-forward decoding")
    save_png(fig, out)


if __name__ == "__main__":
    main()
