"""Soak: thousands of requests through a real `sgl-lite serve` process under a deliberately small KV pool.

    python scripts/soak.py                                   # 3000 requests, tiny random model
    python scripts/soak.py --requests 10000 --fault-every 500 --output soak.json
    python scripts/soak.py --model-path smollm2-135m --requests 2000 --max-total-tokens 2048

Many client threads (bare DEALER sockets and RuntimeClient users) send requests with shared prefixes,
random lengths and priorities (the server runs with --enable-priority-scheduling), abort some, close
their socket or client mid-stream, and a few client processes are SIGKILLed mid-stream. At the end it
checks: every request got exactly one final message; greedy outputs equal an unloaded in-process
Engine's (one request at a time, big pool); the idle accounting invariant (free + evictable +
protected == total, nothing running or waiting); and that the server's RSS grew by at most
--rss-tolerance-mib from the first checkpoint (after the first --rss-every requests) to the last.
`--fault-every N` sets the SGL_LITE_FAULT_INJECT=forward:N test hook in the server: every Nth forward
pass fails, and only that batch's requests may end with the "forward pass failed" error.
Unless --no-hostile, hostile and careless clients run beside the normal ones the whole time
(sgl_lite/testing/hostile_clients.py: nested messages, over-long rids, a peer that never reads, over-limit
stop strings and grammars on the wire; over-cap fan-out, over-limit bodies, slowloris headers and hang-ups
before the first event over an HTTP front): each must get its error, and the checks above must still hold.
Unless --no-hog-and-compile, a prefill hog (/generate batches of --hog-prompts prompts as long as the
context, resent as soon as answered, after one batch over what one request may prefill, which must get its
400) and a runaway grammar compile (refused after --grammar-compile-timeout, resent) run over the server's
own HTTP API the whole time too (sgl_lite/testing/hostile_load.py): every hog batch must be answered 200 (or
with an error the soak expects: the injected fault, the queue's cap, a more urgent request's abort), every
compile refused with 400, and /health answer 200.
Exit status 0 when every check passes; a JSON report goes to --output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.lang.launcher import Runtime, _child_env  # noqa: E402
from sgl_lite.runtime import protocol  # noqa: E402
from sgl_lite.runtime.model_executor.fault_injection import ENV_VAR  # noqa: E402
from sgl_lite.runtime.server.engine import Engine  # noqa: E402
from sgl_lite.testing.hostile_clients import HostileRun, hostile_server_args  # noqa: E402
from sgl_lite.testing.hostile_load import hostile_load_problems, soak_load  # noqa: E402
from sgl_lite.testing.kv_accounting import accounting_problems, idle_server_info  # noqa: E402
from sgl_lite.testing.soak import SoakConfig, run_soak  # noqa: E402
from sgl_lite.testing.soak_checks import (  # noqa: E402
    check_records,
    greedy_mismatches,
    reference_outputs,
)
from sgl_lite.testing.tiny_model import make_tiny_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="Model to serve (default: a tiny random model written to a temp dir).")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--raw-workers", type=int, default=8)
    p.add_argument("--api-workers", type=int, default=2)
    p.add_argument("--in-flight", type=int, default=4, help="Requests in flight per raw worker.")
    p.add_argument("--max-total-tokens", type=int, default=640, help="KV pool (small on purpose).")
    p.add_argument("--max-running-requests", type=int, default=12)
    p.add_argument("--max-queued-requests", type=int, default=32)
    p.add_argument("--schedule-conservativeness", type=float, default=0.1)
    p.add_argument("--schedule-policy", default="lpm")
    p.add_argument("--priority-aging-rate", type=float, default=0.0,
                   help="0 (static priorities, SGLang's) lets low-priority requests wait for minutes under load.")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--killed-clients", type=int, default=5)
    p.add_argument("--fault-every", type=int, default=0, help="Inject a failing forward pass every N passes (0: off).")
    p.add_argument("--rss-every", type=int, default=1000, help="Sample the server's RSS after every N requests.")
    p.add_argument("--rss-tolerance-mib", type=float, default=None,
                   help="Default 16, or 32 with --hog-and-compile: beside the hog the server's RSS rises by steps to a "
                        "plateau that does not grow with the number of requests (docs/safety.md).")
    p.add_argument("--hostile", action=argparse.BooleanOptionalAction, default=True,
                   help="Run the hostile clients beside the normal ones (default: yes).")
    p.add_argument("--hog-and-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="Run a prefill hog and a runaway grammar compile beside everything (default: yes).")
    p.add_argument("--hog-prompts", type=int, default=4,
                   help="Prompts per hog batch (fewer than one request may prefill: the queue has a cap).")
    p.add_argument("--grammar-compile-timeout", type=float, default=2.0,
                   help="The server's flag: how long the runaway compile runs before its 400.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=artifact_path("soak_report.json"))
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.rss_tolerance_mib is None:
        args.rss_tolerance_mib = 32.0 if args.hog_and_compile else 16.0
    tmp = tempfile.TemporaryDirectory()
    model = args.model_path or str(make_tiny_model(Path(tmp.name) / "model"))
    config = SoakConfig(num_requests=args.requests, raw_workers=args.raw_workers, api_workers=args.api_workers,
                        in_flight_per_worker=args.in_flight, killed_client_processes=args.killed_clients,
                        rss_checkpoints=max(2, args.requests // args.rss_every), seed=args.seed)
    if args.fault_every:
        os.environ[ENV_VAR] = f"forward:{args.fault_every}"  # inherited by the server process only
        config.expected_abort_reasons += ("forward pass failed: InjectedFault",)
    server_args = dict(dtype="float32", device="cpu", context_length=args.context_length,
                       max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
                       max_queued_requests=args.max_queued_requests, chunked_prefill_size=64,
                       schedule_conservativeness=args.schedule_conservativeness, schedule_policy=args.schedule_policy,
                       enable_priority_scheduling=True, priority_aging_rate=args.priority_aging_rate,
                       log_level="warning", grammar_compile_timeout=args.grammar_compile_timeout)
    caps = hostile_server_args(runaway_compiles=args.hog_and_compile)
    if args.hostile or args.hog_and_compile:
        server_args.update(caps)
    with Runtime(model_path=model, startup_timeout=600, client_timeout=600, **server_args) as rt:
        os.environ.pop(ENV_VAR, None)
        print(f"server pid {rt.pid} at {rt.address}; {args.requests} requests ...", flush=True)
        tolerated = (*config.expected_abort_reasons, "the request queue is full")
        load = soak_load(rt.url, rt.client.server_info(), max_prompts=args.hog_prompts, seed=args.seed,
                         api_key=rt.api_key, tolerated=tolerated) if args.hog_and_compile else None
        with HostileRun(rt.address, seed=args.seed, caps=caps) if args.hostile else contextlib.nullcontext() as hostile, \
                load if load is not None else contextlib.nullcontext():
            result = run_soak(rt.address, config, server_pid=rt.pid, child_env=_child_env())
            if load is not None:
                load.wait_answered(timeout_s=4 * args.grammar_compile_timeout + 60)
        info = idle_server_info(rt.client, timeout=120.0)  # the hog's last batch ends once its abort is seen
    summary = result.summary()
    print("soak:", json.dumps(summary), flush=True)
    problems = list(result.problems) + check_records(result.records, config) + accounting_problems(info)
    if hostile is not None:
        problems += hostile.report.problems
    if load is not None:
        problems += hostile_load_problems(load.report())
    growth_mib = (result.rss_kib[-1] - result.rss_kib[0]) / 1024
    if growth_mib > args.rss_tolerance_mib:
        problems.append(f"server RSS grew {growth_mib:.1f} MiB (> {args.rss_tolerance_mib} MiB): {summary['rss_mib']}")
    print("computing unloaded greedy references ...", flush=True)
    with Engine(model_path=model, dtype="float32", device="cpu", context_length=args.context_length,
                max_total_tokens=16384) as engine:
        refs = reference_outputs(engine, result.records)
    problems += greedy_mismatches(result.records, refs)
    report = {**summary, "rss_growth_mib": round(growth_mib, 2), "rss_tolerance_mib": args.rss_tolerance_mib,
              "greedy_compared": sum(r.greedy and isinstance(r.final, protocol.Finished) for r in result.records),
              "num_retractions": info["num_retractions"], "num_preemptions": info["num_preemptions"],
              "cache_hit_rate": info["cache_hit_rate"], "num_problems": len(problems), "problems": problems[:50],
              "server_args": server_args, "fault_every": args.fault_every,
              "hostile_attempts": hostile.report.attempts if hostile is not None else {},
              "hog_and_compile": load.report() if load is not None else {}}
    output_file(args.output).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("problems", "server_args")}), flush=True)
    for problem in problems[:20]:
        print("PROBLEM:", problem, flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
