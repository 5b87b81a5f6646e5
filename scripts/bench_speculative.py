"""N-gram speculative decoding on and off, in one run: output tokens/s and acceptance per workload.

Workloads (greedy, chat-templated text on the default model, in-process Engine):
- copy: the answer copies from the context (repeat a tool output with one field changed, rename a
  variable in code, quote log lines): where n-gram drafts should pay;
- agent: 4-turn sessions, each turn appending a tool observation the model must act on;
- random: prompts of random tokens, where drafts rarely match: the cost of trying.
Each is run at several concurrencies (requests in flight at once: 1 = one request after another);
the two systems alternate per measurement, --repeats times, and each reports its fastest run, so
that drift on a shared box hits both alike. Greedy outputs of the two systems are compared token by
token (they must be identical). The copy and random workloads hold max(--num-prompts, --concurrency)
prompts: at concurrency 1 a single prompt would make the cell one request.

Usage: python scripts/bench_speculative.py [--concurrency 1 8 32] [--max-new-tokens 64] [--repeats 3] [--out artifacts/bench_speculative.json]
       python scripts/bench_speculative.py --step-cost   (step time by rows: the draft-length policy's prior and its online estimate)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.bench.workloads import Vocabulary, random_prompts  # noqa: E402
from sgl_lite.runtime.server.engine import Engine  # noqa: E402

RECORDS = [("alpha", 42, "ok", "eu-west"), ("beta", 7, "pending", "us-east"), ("gamma", 311, "failed", "ap-south"),
           ("delta", 95, "ok", "eu-central"), ("epsilon", 18, "retry", "us-west"), ("zeta", 260, "ok", "sa-east"),
           ("eta", 3, "queued", "af-south"), ("theta", 77, "ok", "me-central")]


def copy_prompts(n: int) -> list[tuple[str, str]]:
    """(user message, start of the answer) pairs whose answers copy from the message: a tool's JSON
    repeated with one field changed, code re-emitted with a variable renamed (the answer begun, as an
    agent framework does to pin the format), log lines quoted. The default model copies most of them:
    it repeats the JSON (pretty-printed) and quotes the log lines (some fields changed), but closes two of
    the three begun code fences at once and restarts the third (docs/speculative.md)."""
    out = []
    for i in range(n):
        name, ident, status, region = RECORDS[i % len(RECORDS)]
        kind = i % 3
        if kind == 0:
            out.append((f'The tool returned: {{"name": "{name}", "id": {ident}, "status": "{status}", "region": "{region}", '
                        f'"retries": {i}, "owner": "team-{name}"}}\nRepeat this JSON exactly, but with "status" set to "done".', ""))
        elif kind == 1:
            code = (f"def summarize(values):\n    total = 0\n    for v in values:\n        total += v * {ident}\n"
                    f"    if total > {ident * 10}:\n        return total - {i}\n    return total\n")
            out.append((f"Rewrite this code with the variable `total` renamed to `{name}_sum`:\n\n```python\n{code}```",
                        f"```python\ndef summarize(values):\n    {name}_sum = 0\n"))
        else:
            lines = [RECORDS[(i + j) % len(RECORDS)] for j in range(6)]
            log = "".join(f"10:4{j} {r[0]}-service status {r[2]} region {r[3]}\n" for j, r in enumerate(lines))
            out.append((f"Log:\n{log}Copy the log lines above exactly, in the same order.", ""))
    return out


def agent_turns(n: int) -> list[list[str]]:
    """Per session: the user turns (the first asks, the later ones bring tool observations)."""
    sessions = []
    for i in range(n):
        name, ident, status, region = RECORDS[i % len(RECORDS)]
        sessions.append([
            f"You are an operations agent. Check the deployment {name} (id {ident}) and report its state.",
            f'Observation: {{"deployment": "{name}", "id": {ident}, "status": "{status}", "region": "{region}"}}. '
            "Summarize the observation in one sentence.",
            f"Observation: the logs of {name} say 'connection reset by peer' three times. What do you do next?",
            f"Observation: restarting {name} in {region} succeeded. Write the final report for deployment {name}.",
        ])
    return sessions


def chat(engine: Engine, messages: list[dict]) -> list[int]:
    tokenizer = engine.core.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_batch(engine: Engine, prompts: list[list[int]], params: dict, concurrency: int) -> list[dict]:
    outs: list[dict] = []
    for start in range(0, len(prompts), concurrency):
        outs += engine.generate(input_ids=prompts[start : start + concurrency], sampling_params=params)
    return outs


def run_agent(engine: Engine, sessions: list[list[str]], params: dict, concurrency: int) -> list[dict]:
    outs: list[dict] = []
    for start in range(0, len(sessions), concurrency):
        group = sessions[start : start + concurrency]
        histories: list[list[dict]] = [[] for _ in group]
        for turn in range(len(group[0])):
            for history, turns in zip(histories, group):
                history.append({"role": "user", "content": turns[turn]})
            results = engine.generate(input_ids=[chat(engine, h) for h in histories], sampling_params=params)
            for history, result in zip(histories, results):
                history.append({"role": "assistant", "content": result["text"]})
            outs += results
    return outs


def measure(engine: Engine, workload: str, data, params: dict, concurrency: int) -> dict:
    engine.flush_cache()
    before = engine.core.scheduler.stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = run_agent(engine, data, params, concurrency) if workload == "agent" else run_batch(engine, data, params, concurrency)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    after = engine.core.scheduler.stats()
    drafted = after.get("spec_draft_tokens", 0) - before.get("spec_draft_tokens", 0)
    accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
    steps = after["num_forward_steps"] - before["num_forward_steps"]
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "cpu_seconds": cpu_seconds, "output_tokens": tokens, "forward_steps": steps,
            "draft_tokens": drafted, "accepted_tokens": accepted, "accept_rate": accepted / drafted if drafted else 0.0,
            "output_ids": [o["output_ids"] for o in outs]}


def step_cost(model: str, dtype: str) -> None:
    """Ms per decode step with B rows each verifying k forced (always rejected) draft tokens, best of 3,
    and what a draft token and a decode row cost relative to a one-request step: what the draft-length
    policy's prior (step_cost.DRAFT_TOKEN_STEP_COST, DECODE_ROW_STEP_COST) stands for, the costs it
    uses until the runtime has timed its own decode forwards. Then the runtime's online estimate after
    these steps (step_cost.StepCost: ms by query rows), to compare with the timings above."""
    engine = Engine(model_path=model, dtype=dtype, max_running_requests=16, speculative_algorithm="ngram",
                    speculative_num_draft_tokens=8, log_level="warning")
    scheduler = engine.core.scheduler
    proposer = scheduler.proposer
    proposer.record = lambda *args: None  # forced drafts: no back-off
    prompt = list(range(1000, 1150))
    ms: dict[tuple[int, int], float] = {}
    for batch in (1, 8, 16):
        for k in (0, 4):
            proposer.propose = lambda req, limit, step=None, k=k: [7] * min(k, limit)
            best = float("inf")
            for rep in range(3):
                steps = scheduler.stats()["num_forward_steps"]
                start = time.perf_counter()
                engine.generate(input_ids=[[batch, rep, k] + prompt] * batch,
                                sampling_params={"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
                best = min(best, (time.perf_counter() - start) / (scheduler.stats()["num_forward_steps"] - steps))
            ms[batch, k] = best * 1e3
            print(f"rows {batch:2d}, draft tokens per row {k}: {ms[batch, k]:.1f} ms/step")
    estimate = ", ".join(f"{rows:.0f}: {1e3 * seconds:.1f}" for rows, seconds in proposer.step_cost.points())
    engine.shutdown()
    print(f"online estimate, ms by query rows: {estimate}")
    draft = sum((ms[b, 4] - ms[b, 0]) / (4 * b) for b in (1, 8, 16)) / 3
    row = (ms[16, 0] - ms[1, 0]) / 15
    print(f"draft token {draft:.2f} ms = {draft / ms[1, 0]:.3f} of a one-request step; "
          f"decode row {row:.2f} ms = {row / ms[1, 0]:.3f} (load average {os.getloadavg()[0]:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each cell, off and ngram alternating; the fastest of each is reported")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="--speculative-num-draft-tokens (default: the server's)")
    parser.add_argument("--deterministic", action="store_true", help="--enable-deterministic-inference on both systems")
    parser.add_argument("--ngram-capacity", type=int, default=None, help="--speculative-ngram-capacity: the shared pool of recent outputs (default: the server's; 0: none)")
    parser.add_argument("--workloads", nargs="+", default=["copy", "agent", "random"])
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts of the copy and random workloads (at least the largest --concurrency)")
    parser.add_argument("--out", default=artifact_path("bench_speculative.json"))
    parser.add_argument("--step-cost", action="store_true", help="only measure what a draft token and a decode row add to a step (the draft-length policy's prior) "
                        "and print the runtime's online estimate of step time by rows")
    args = parser.parse_args()
    if args.step_cost:
        step_cost(args.model, args.dtype)
        return

    common = dict(model_path=args.model, dtype=args.dtype, max_running_requests=max(args.concurrency),
                  enable_deterministic_inference=args.deterministic)
    systems = {"off": Engine(**common), "ngram": Engine(**common, speculative_algorithm="ngram",
                                                         speculative_num_draft_tokens=args.num_draft_tokens,
                                                         **({} if args.ngram_capacity is None else {"speculative_ngram_capacity": args.ngram_capacity}))}
    tokenizer = systems["off"].core.tokenizer
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": False}
    n = max(args.num_prompts, *args.concurrency)
    vocab = Vocabulary.from_tokenizer(tokenizer)
    data = {
        "copy": [chat(systems["off"], [{"role": "user", "content": p}]) + tokenizer(start, add_special_tokens=False)["input_ids"]
                 for p, start in copy_prompts(n)],
        "agent": agent_turns(max(2, n // 4)),
        "random": [list(s.first_prompt) for s in random_prompts(vocab, num_prompts=n, input_len=128,
                                                                  output_len=args.max_new_tokens, seed=0).sessions],
    }
    results: list[dict] = []
    plan = [(w, c) for w in args.workloads for c in args.concurrency]
    for workload, concurrency in tqdm(plan, desc="bench_speculative"):
        row: dict = {"workload": workload, "concurrency": concurrency}
        for _ in range(args.repeats):  # the two systems alternate, so a slow spell of the box hits both
            for name, engine in systems.items():
                run = measure(engine, workload, data[workload], params, concurrency)
                if name not in row or run["tok_s"] > row[name]["tok_s"]:
                    row[name] = run
        row["identical"] = row["off"].pop("output_ids") == row["ngram"].pop("output_ids")
        row["speedup"] = row["ngram"]["tok_s"] / row["off"]["tok_s"]
        # CPU seconds per output token (all threads of this process): less sensitive to other jobs on the box.
        row["cpu_speedup"] = (row["off"]["cpu_seconds"] / row["off"]["output_tokens"]) / (
            row["ngram"]["cpu_seconds"] / row["ngram"]["output_tokens"])
        results.append(row)
    for engine in systems.values():
        engine.shutdown()

    print(f"\nload average {os.getloadavg()[0]:.2f}; model {args.model}, greedy, {args.max_new_tokens} new tokens, best of {args.repeats}, "
          f"{args.num_draft_tokens or 'default'} draft tokens, shared pool {systems['ngram'].args.speculative_ngram_capacity} tokens")
    print("| workload | concurrency | off tok/s | ngram tok/s | speedup | CPU-time speedup | accept rate | tokens/step off -> ngram | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        off, on = r["off"], r["ngram"]
        print(f"| {r['workload']} | {r['concurrency']} | {off['tok_s']:.1f} | {on['tok_s']:.1f} | {r['speedup']:.2f}x | {r['cpu_speedup']:.2f}x | "
              f"{on['accept_rate']:.0%} | {off['output_tokens'] / max(off['forward_steps'], 1):.2f} -> "
              f"{on['output_tokens'] / max(on['forward_steps'], 1):.2f} | {r['identical']} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['workload']}\nc={r['concurrency']}" for r in results]
        ax.bar(labels, [r["speedup"] for r in results])
        ax.axhline(1.0, color="gray", linestyle="--")
        ax.set_ylabel("ngram / off output tok/s")
        ax.set_title("N-gram speculative decoding")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"))
    except ImportError:
        pass
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
