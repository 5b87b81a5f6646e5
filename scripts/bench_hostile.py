"""Short chats beside hostile clients: their time to first token against an unloaded run, same server,
same run (docs/safety.md, "Fairness under hostile load").

    python scripts/bench_hostile.py                                   # smollm2-135m, ~10 minutes on 2 CPU cores
    python scripts/bench_hostile.py --phases unloaded,hog+compile --chats 40
    python scripts/bench_hostile.py --serve-args="--chunked-prefill-size 512"

One `sgl-lite serve` (sgl.Runtime). After a warm-up (a chat, and a small constrained request so that the
grammar workers' start is not measured), each phase serves short chats of the same shape (streaming
/v1/chat/completions: one user message of --chat-input-len random tokens, --chat-output-len tokens out,
Poisson arrivals at --chat-rate per second; fresh prompts per phase, so no phase hits another's cache):

- unloaded: nothing else runs;
- hog: beside a prefill hog (sgl_lite/testing/hostile_load.py): --hog-streams /generate batches in flight,
  each of prompts of --hog-prompt-tokens random ids, as many as the server's limit on one request's
  prompts allows (guards/prompt_budget.py), sent again as soon as answered; first one batch over that
  limit, which must be refused;
- compile: beside --compile-streams runaway grammar compiles (a 24 KB regex refused after
  --grammar-compile-timeout), sent again as soon as refused;
- hog+compile: beside both.

Each phase starts once the runtime is idle (nothing running or waiting); its hostile load starts --settle-s
seconds before its first chat and stops after its last. Prints
the chats' table per phase (sgl_lite.bench.report), the p99 TTFT of each phase over the unloaded one
against --goal (5x), and what the hostile requests and /health probes got; writes the JSON and the
latency plot under artifacts/bench_hostile/. Exit 1 when a chat failed or the over-limit batch was not
refused with a 400.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx2  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.bench.config import BenchConfig, make_workload, parse_config  # noqa: E402
from sgl_lite.bench.driver import resolve_model, run_workload  # noqa: E402
from sgl_lite.bench.metrics import summarize  # noqa: E402
from sgl_lite.bench.openai_chat_backend import OpenAIChatBackend  # noqa: E402
from sgl_lite.bench.report import markdown_table, write_plots  # noqa: E402
from sgl_lite.bench.workloads import TokenSampler  # noqa: E402
from sgl_lite.lang.launcher import Runtime  # noqa: E402
from sgl_lite.runtime.model_executor import loader  # noqa: E402
from sgl_lite.testing.hostile_load import HogPlan, HostileLoad  # noqa: E402

PHASES = ("unloaded", "hog", "compile", "hog+compile")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--phases", default=",".join(PHASES), help=f"Comma-separated, from {', '.join(PHASES)}; "
                   "unloaded is always run first (the baseline).")
    p.add_argument("--chats", type=int, default=60, help="Short chats per phase.")
    p.add_argument("--chat-rate", type=float, default=1.0, help="Chats per second (Poisson arrivals).")
    p.add_argument("--chat-input-len", type=int, default=32)
    p.add_argument("--chat-output-len", type=int, default=8)
    p.add_argument("--hog-streams", type=int, default=2, help="Hog batches in flight at once.")
    p.add_argument("--hog-prompt-tokens", type=int, default=8000, help="Tokens per hog prompt (capped by the context).")
    p.add_argument("--compile-streams", type=int, default=1, help="Runaway compiles in flight at once.")
    p.add_argument("--settle-s", type=float, default=5.0, help="Seconds of hostile load before a phase's first chat.")
    p.add_argument("--goal", type=float, default=5.0, help="The p99 TTFT ratio (phase / unloaded) to stay within.")
    p.add_argument("--serve-args", default="", help="Extra `sgl-lite serve` flags, e.g. \"--chunked-prefill-size 512\".")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-dir", default=artifact_path("bench_hostile"))
    return p.parse_args()


def serve_kwargs(flags: str) -> dict[str, Any]:
    """`--serve-args` as the keyword arguments sgl.Runtime takes (parsed as `sgl-lite bench` parses them)."""
    return parse_config(shlex.split(flags)).server_args


def warm_up(url: str, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"text": "Answer yes or no: ", "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 4}}
    httpx2.post(url + "/generate", json=body, headers=headers, timeout=600).raise_for_status()


def wait_idle(rt: Runtime, timeout_s: float = 300.0) -> float:
    """Seconds until the runtime has nothing running or waiting (a cancelled hog's last forward still
    runs when its phase ends): the next phase starts on an idle server."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        info = rt.client.server_info()
        if not info.get("num_running") and not info.get("num_waiting"):
            break
        time.sleep(0.5)
    return time.perf_counter() - started


def run_phase(phase: str, backend: OpenAIChatBackend, config: BenchConfig, vocab: Any, rt: Runtime,
              args: argparse.Namespace, hog: HogPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    workload = make_workload(config, vocab)
    sampler = TokenSampler(vocab, config.seed + 1000)
    load = None
    load_before = os.getloadavg()[0]
    if phase != "unloaded":
        load = HostileLoad(rt.url, sampler.tokens, hog=hog if "hog" in phase else None,
                           compile_streams=args.compile_streams if "compile" in phase else 0, api_key=rt.api_key)
        load.__enter__()
    try:
        if load is not None:
            time.sleep(args.settle_s)

        async def chats() -> tuple[list[Any], float]:
            try:
                return await run_workload(backend, workload, request_rate=args.chat_rate, seed=config.seed)
            finally:
                await backend.close_async_resources()

        records, duration = asyncio.run(chats())
    finally:
        if load is not None:
            load.__exit__(None, None, None)
    summary = summarize(phase, records, duration)
    summary["load_avg_1m"] = [load_before, os.getloadavg()[0]]  # other work on the machine skews a phase
    summary["failed"] = workload.num_requests - summary["completed"]
    summary["requests"] = [r.to_json() for r in records]
    return summary, load.report() if load is not None else {}


def ratio_table(summaries: list[dict[str, Any]], goal: float) -> list[dict[str, Any]]:
    base = summaries[0]["ttft_ms"]
    rows = []
    for s in summaries:
        ttft = s["ttft_ms"]
        ratio = ttft["p99"] / base["p99"] if ttft["p99"] is not None and base["p99"] else None
        rows.append({"phase": s["system"], "ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"],
                     "p99_over_unloaded": ratio, "within_goal": ratio is not None and ratio <= goal})
    return rows


def format_ratios(rows: list[dict[str, Any]], goal: float) -> str:
    lines = [f"| phase | TTFT p50 (ms) | TTFT p99 (ms) | p99 / unloaded p99 | within {goal:g}x |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["p99_over_unloaded"] is None else f"{r['p99_over_unloaded']:.2f}"
        lines.append(f"| {r['phase']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {ratio} | "
                     f"{'yes' if r['within_goal'] else 'no'} |")
    return "\n".join(lines)


def format_hostile(hostile: dict[str, dict[str, Any]]) -> str:
    lines = ["| phase | client | sent | answers by status | median s | max s |", "|---|---|---|---|---|---|"]
    for phase, streams in hostile.items():
        for name, s in streams.items():
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(s["statuses"].items())) or "-"
            med = "-" if s["seconds_median"] is None else f"{s['seconds_median']:.2f}"
            top = "-" if s["seconds_max"] is None else f"{s['seconds_max']:.2f}"
            lines.append(f"| {phase} | {name} | {s['sent']} | {statuses} | {med} | {top} |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    phases = ["unloaded", *[p for p in args.phases.split(",") if p and p != "unloaded"]]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise SystemExit(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    model_path, vocab = resolve_model(BenchConfig(model_path=args.model_path))
    tokenizer = loader.load_tokenizer(loader.resolve_model_path(model_path))
    summaries, hostile = [], {}
    with Runtime(model_path, startup_timeout=900, **serve_kwargs(args.serve_args)) as rt:
        info = rt.client.server_info()
        hog = HogPlan.for_server(info, args.hog_streams, args.hog_prompt_tokens)
        print(f"server at {rt.url}; hog: {hog}", flush=True)
        warm_up(rt.url, rt.api_key)
        backend = OpenAIChatBackend("chats", rt.url, tokenizer, api_key=rt.api_key)
        asyncio.run(_warm_chat(backend))
        for index, phase in enumerate(phases):
            config = BenchConfig(model_path=model_path, workload="random", num_prompts=args.chats,
                                 random_input_len=args.chat_input_len, random_output_len=args.chat_output_len,
                                 seed=args.seed + index, progress=False, plots=False)
            idle_s = wait_idle(rt)
            started = time.strftime("%H:%M:%S")
            summary, hostile[phase] = run_phase(phase, backend, config, vocab, rt, args, hog)
            summary["idle_wait_s"] = idle_s
            print(f"{started} {phase}: {summary['completed']} chats, TTFT p99 {summary['ttft_ms']['p99']:.0f} ms",
                  flush=True)
            summaries.append(summary)
        server_args = info.get("server_args")
    rows = ratio_table(summaries, args.goal)
    print(markdown_table(summaries) + "\n\n" + format_ratios(rows, args.goal) + "\n\n" + format_hostile(hostile))
    stem = f"bench_hostile_{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(args.output_dir)
    report = {"model_path": model_path, "args": vars(args), "hog": dataclasses.asdict(hog), "server_args": server_args,
              "ratios": rows, "hostile": hostile, "phases": summaries}
    try:
        report["plots"] = [str(p) for p in write_plots(summaries, out_dir, stem, per_turn=False)]
    except ImportError:
        report["plots"] = []  # matplotlib is optional
    path = output_file(out_dir / f"{stem}.json")
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"report: {path}" + (f"; plots: {', '.join(report['plots'])}" if report["plots"] else ""))
    over_limit = [streams["hog over the limit"]["statuses"] for streams in hostile.values()
                  if "hog over the limit" in streams]
    refused = all(statuses == {"400": 1} for statuses in over_limit)
    return 0 if refused and all(s["failed"] == 0 for s in summaries) else 1


async def _warm_chat(backend: OpenAIChatBackend) -> None:
    try:
        await backend.warm_up()
    finally:
        await backend.close_async_resources()


if __name__ == "__main__":
    sys.exit(main())
