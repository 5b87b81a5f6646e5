"""Agent sessions that outgrow the KV pool: returning-turn time to first token with the disk tier off (every
return recomputes its evicted context) and on (`--enable-hierarchical-cache`: it loads it), in one run.

The workload: --sessions agent sessions share a system prompt; each turn appends a tool result of
--tool-tokens random token ids to the session's transcript (its prompt, then the model's --output-tokens
greedy output), so a session grows from about --start-tokens to start + turns * (tool + output) tokens. Turns go
round robin, one request at a time, so every other session's turn is this one's think time, and the pool is
sized (--pool-fraction of the sessions' final KV, by --max-total-tokens) so that a returning session finds its
context evicted. Half way, the server is restarted (same storage folder): the next turn of each session
shows what survives a restart. Token ids, not text: a prompt is exactly the last turn's prompt and output plus
the new tool result, whatever the tokenizer would make of the text.

Each system (tier off, tier on with each of --write-policies) runs the same turns on a fresh `sgl-lite serve`. Reported per system: TTFT
of returning turns (p50, p95), of the first turn after the restart, tokens loaded from disk, throughput (prompt +
output tokens per second of wall time, restart excluded), and the ratio off/on in the same run.

Usage: python scripts/bench_sessions.py [--model-path smollm2-135m|random-1.7b] [--sessions 4] [--turns 4]
       [--start-tokens 2000] [--tool-tokens 300] [--output-tokens 16] [--pool-fraction 0.25]
       [--write-policies write_through write_back] [--out artifacts/bench_sessions.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, save_png  # noqa: E402
from sgl_lite.lang.launcher import Runtime  # noqa: E402

SYSTEM_TOKENS = 400
VOCAB = (100, 40000)  # ids drawn from the default tokenizer's ordinary range


def session_prompts(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each session's opening prompt and its tool results, seeded."""
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(*VOCAB) for _ in range(n)]  # noqa: E731
    system = draw(SYSTEM_TOKENS)
    openings = [system + draw(args.start_tokens - SYSTEM_TOKENS) for _ in range(args.sessions)]
    tools = [[draw(args.tool_tokens) for _ in range(args.turns)] for _ in range(args.sessions)]
    return openings, tools


def one_turn(rt: Runtime, prompt: list[int], output_tokens: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": output_tokens, "ignore_eos": True}
    start = time.perf_counter()
    ttft, output, meta = None, [], {}
    for chunk in rt.client.generate_stream(input_ids=prompt, sampling_params=params):
        if ttft is None:
            ttft = time.perf_counter() - start
        output += chunk.output_ids
        meta = chunk.meta_info or meta
    details = meta.get("cached_tokens_details") or {}
    return {"prompt_tokens": len(prompt), "ttft_s": ttft, "e2e_s": time.perf_counter() - start, "output": output,
            "cached_tokens": meta.get("cached_tokens", 0), "storage_tokens": details.get("storage", 0)}


def start_server(args: argparse.Namespace, pool: int, tier_dir: str | None, policy: str | None) -> Runtime:
    extra = {"enable_hierarchical_cache": True, "hicache_storage_dir": tier_dir,
             "hicache_write_policy": policy} if tier_dir else {}
    return Runtime(model_path=args.model_path, max_total_tokens=pool, context_length=args.context_length,
                   log_level="warning", startup_timeout=1800, client_timeout=3600, **extra)


def run_system(args: argparse.Namespace, name: str, pool: int, tier_dir: str | None = None,
               policy: str | None = None) -> dict:
    openings, tools = session_prompts(args)
    prompts = [list(p) for p in openings]
    turns, restart_turns, wall, tokens = [], [], 0.0, 0
    rt = start_server(args, pool, tier_dir, policy)
    bar = tqdm(total=args.turns * args.sessions, desc=name, unit="turn")
    try:
        for turn in range(args.turns):
            if turn == args.turns // 2:
                rt.shutdown()
                rt = start_server(args, pool, tier_dir, policy)
            start = time.perf_counter()
            for s in range(args.sessions):
                result = one_turn(rt, prompts[s], args.output_tokens)
                result.update(session=s, turn=turn)
                (restart_turns if turn == args.turns // 2 else turns).append(result)
                prompts[s] = prompts[s] + result.pop("output") + tools[s][turn]
                tokens += result["prompt_tokens"] + args.output_tokens
                bar.update(1)
            wall += time.perf_counter() - start
        info = rt.client.server_info()
    finally:
        bar.close()
        rt.shutdown()
    returning = [r["ttft_s"] for r in turns if r["turn"] > 0]
    return {"system": name, "turns": turns + restart_turns,
            "returning_ttft_p50_s": statistics.median(returning),
            "returning_ttft_p95_s": sorted(returning)[max(0, round(0.95 * len(returning)) - 1)],
            "after_restart_ttft_p50_s": statistics.median(r["ttft_s"] for r in restart_turns),
            "after_restart_storage_tokens": sum(r["storage_tokens"] for r in restart_turns),
            "storage_tokens": sum(r["storage_tokens"] for r in turns + restart_turns),
            "throughput_tok_s": tokens / wall,
            "hicache": {k: v for k, v in info.items() if k.startswith("hicache_")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--start-tokens", type=int, default=2000)
    p.add_argument("--tool-tokens", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.25, help="pool size / the sessions' final KV")
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-policies", nargs="+", default=["write_through"], choices=["write_through", "write_back"])
    p.add_argument("--out", default=artifact_path("bench_sessions.json"))
    args = p.parse_args()
    final = args.sessions * (args.start_tokens + args.turns * (args.tool_tokens + args.output_tokens))
    pool = max(int(final * args.pool_fraction), args.start_tokens + args.turns * (args.tool_tokens + args.output_tokens) + 64)
    print(f"{args.sessions} sessions x {args.turns} turns, final KV {final} tokens, pool {pool} tokens "
          f"({final / pool:.1f}x), model {args.model_path}")
    results = [run_system(args, "tier off (recompute)", pool)]
    for policy in args.write_policies:
        with tempfile.TemporaryDirectory(prefix="sgl-lite-bench-tier-") as tier_dir:
            results.append(run_system(args, f"tier on, {policy}", pool, tier_dir, policy))
    print("\n| system | returning TTFT p50 | p95 | first turn after restart p50 | tokens from disk | throughput tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['system']} | {r['returning_ttft_p50_s']:.2f} s | {r['returning_ttft_p95_s']:.2f} s | "
              f"{r['after_restart_ttft_p50_s']:.2f} s | {r['storage_tokens']} | {r['throughput_tok_s']:.0f} |")
    off = results[0]
    ratios = {on["system"]: {"returning_ttft_p50": off["returning_ttft_p50_s"] / on["returning_ttft_p50_s"],
                             "returning_ttft_p95": off["returning_ttft_p95_s"] / on["returning_ttft_p95_s"],
                             "after_restart_ttft_p50": off["after_restart_ttft_p50_s"] / on["after_restart_ttft_p50_s"],
                             "throughput": on["throughput_tok_s"] / off["throughput_tok_s"]} for on in results[1:]}
    for name, ratio in ratios.items():
        print(f"off / {name}: " + ", ".join(f"{k} {v:.1f}x" for k, v in ratio.items()))
    out = output_file(args.out)
    out.write_text(json.dumps({"config": vars(args) | {"pool_tokens": pool, "final_kv_tokens": final},
                               "results": results, "ratios": ratios}, indent=1))
    print(f"wrote {out}")
    plot(results, out)


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        points = sorted((t["turn"], t["session"], t["ttft_s"]) for t in r["turns"])
        ax.plot(range(len(points)), [p[2] for p in points], marker="o", label=r["system"])
    ax.set_xlabel("turn (round robin over sessions)")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.legend()
    save_png(fig, out)


if __name__ == "__main__":
    main()
