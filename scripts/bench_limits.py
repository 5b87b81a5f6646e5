"""What the limits of docs/safety.md cost: the same workloads against two servers, one after the other in
one run, one with every limit at its default and one with every limit raised to its maximum.

    python scripts/bench_limits.py                         # smollm2-135m, under 2 minutes on a quiet box
    python scripts/bench_limits.py --model-path /path/to/model --agent-sessions 32 --burst-requests 800
    python scripts/bench_limits.py --no-limits-first       # the same with the servers in the other order

Each server is a `sgl-lite serve` (sgl.Runtime: the runtime and its HTTP front). On each, after a
warm-up and a cache flush (sgl_lite.bench.driver.measure_system): the multiturn-agent workload over
streaming `/v1/chat/completions` (sgl_lite.bench.openai_chat_backend), then a burst of short completions
sent at once over SGLang's native `/generate` (sgl_lite.bench.http_backend). Prints a markdown table
per system and workload, then the ratios default-limits / no-limits of output tok/s, TTFT p50/p99 and
ITL p50/p99 (1.0: the limits cost nothing); writes the JSON (and PNG plots when matplotlib is there)
under artifacts/bench_limits/. Only ratios from one run on a quiet machine are worth reporting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.bench.config import BenchConfig, make_workload  # noqa: E402
from sgl_lite.bench.driver import measure_system, resolve_model  # noqa: E402
from sgl_lite.bench.http_backend import HTTPBackend  # noqa: E402
from sgl_lite.bench.openai_chat_backend import OpenAIChatBackend  # noqa: E402
from sgl_lite.bench.report import markdown_table, write_plots  # noqa: E402
from sgl_lite.lang.launcher import Runtime  # noqa: E402
from sgl_lite.runtime.model_executor import loader  # noqa: E402

_HUGE = 2**31 - 1
# Every limit flag of docs/safety.md at its maximum (the waiting queue, --max-queued-requests, is unbounded
# by default already).
NO_LIMITS: dict[str, Any] = {
    "max_message_bytes": _HUGE, "max_queued_replies_per_client": _HUGE, "max_grammar_chars": _HUGE,
    "max_json_schema_depth": _HUGE, "grammar_compile_timeout": 1e9, "max_request_body_bytes": _HUGE,
    "max_chat_messages": _HUGE, "max_request_fanout": _HUGE,
}
SERVERS = {"default-limits": {}, "no-limits": NO_LIMITS}
RATIO_KEYS = (("output tok/s", "output_throughput", None), ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
              ("ITL p50", "itl_ms", "p50"), ("ITL p99", "itl_ms", "p99"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--agent-sessions", type=int, default=16, help="multiturn-agent sessions (4 turns each).")
    p.add_argument("--burst-requests", type=int, default=400, help="Short completions sent at once.")
    p.add_argument("--burst-input-len", type=int, default=32)
    p.add_argument("--burst-output-len", type=int, default=8)
    p.add_argument("--no-limits-first", action="store_true",
                   help="Start the no-limits server first (a server started second can find the box warmer or busier).")
    p.add_argument("--output-dir", default=artifact_path("bench_limits"))
    return p.parse_args()


def workload_configs(args: argparse.Namespace, model_path: str) -> dict[str, BenchConfig]:
    common = dict(model_path=model_path, progress=False, plots=False)
    return {
        "multiturn-agent (chat stream)": BenchConfig(workload="multiturn-agent", agent_num_sessions=args.agent_sessions,
                                                     **common),
        "burst (/generate)": BenchConfig(workload="random", num_prompts=args.burst_requests,
                                         random_input_len=args.burst_input_len,
                                         random_output_len=args.burst_output_len, **common),
    }


def ratios(summaries: dict[tuple[str, str], dict[str, Any]], workloads: list[str]) -> list[dict[str, Any]]:
    rows = []
    for workload in workloads:
        limited, free = summaries[("default-limits", workload)], summaries[("no-limits", workload)]
        row: dict[str, Any] = {"workload": workload}
        for label, key, sub in RATIO_KEYS:
            a, b = (limited[key], free[key]) if sub is None else (limited[key][sub], free[key][sub])
            row[label] = a / b if a is not None and b else None
        rows.append(row)
    return rows


def ratio_table(rows: list[dict[str, Any]]) -> str:
    labels = [label for label, _, _ in RATIO_KEYS]
    lines = ["| workload | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for row in rows:
        lines.append(f"| {row['workload']} | " + " | ".join("-" if row[x] is None else f"{row[x]:.3f}" for x in labels) + " |")
    return "\n".join([*lines, "", "ratio = default-limits / no-limits: output tok/s above 1 and latencies below 1 "
                      "favour the limits; 1.0 means they cost nothing"])


def main() -> int:
    args = parse_args()
    model_path, vocab = resolve_model(BenchConfig(model_path=args.model_path))
    tokenizer = loader.load_tokenizer(loader.resolve_model_path(model_path))
    configs = workload_configs(args, model_path)
    workloads = {name: make_workload(config, vocab) for name, config in configs.items()}
    summaries: dict[tuple[str, str], dict[str, Any]] = {}
    bar = tqdm(total=len(SERVERS) * len(workloads), desc="bench_limits")
    order = list(SERVERS.items())[::-1] if args.no_limits_first else list(SERVERS.items())
    for server, limits in order:
        with Runtime(model_path, startup_timeout=900, **limits) as rt:
            for name, workload in workloads.items():
                bar.set_postfix_str(f"{server}: {name}")
                backend = (OpenAIChatBackend(server, rt.url, tokenizer, api_key=rt.api_key) if "chat" in name
                           else HTTPBackend(server, rt.url, api_key=rt.api_key))
                summary = measure_system(server, configs[name], workload, backend)
                summary["system"] = f"{server} / {name}"
                summaries[(server, name)] = summary
                bar.update(1)
    bar.close()
    rows = ratios(summaries, list(workloads))
    ordered = [summaries[(server, name)] for name in workloads for server in SERVERS]
    print(markdown_table(ordered) + "\n\n" + ratio_table(rows))
    stem = f"bench_limits_{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(args.output_dir)
    report = {"model_path": model_path, "no_limits": NO_LIMITS, "ratios": rows, "args": vars(args),
              "workloads": {name: dataclasses.asdict(c) for name, c in configs.items()}, "systems": ordered}
    try:
        report["plots"] = [str(p) for p in write_plots(ordered, out_dir, stem, per_turn=False)]
    except ImportError:
        report["plots"] = []  # matplotlib is optional
    path = output_file(out_dir / f"{stem}.json")
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"report: {path}" + (f"; plots: {', '.join(report['plots'])}" if report["plots"] else ""))
    return 0 if all(s["failed"] == 0 for s in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
