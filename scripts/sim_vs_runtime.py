"""Check the simulator against the real runtime: same workload, same scheduler flags, one policy.

Runs the workload in process on the real ModelRunner (wall-clock time, the simulator's own replay
loop) and then in the simulator with the runtime's pool size, row limit and context length, and
prints cache hit rate (equal when arrivals do not depend on timing, e.g. --request-rate inf),
throughput and TTFT side by side. Targets: hit rate equal on the tiny model; throughput within 20%
on the default model (calibrate first: python scripts/bench_model.py, which writes artifacts/bench_model.json).
Run it on a quiet machine: the calibration and the real run must see the same CPU; on a box whose
load average exceeds its core count, torch's threads stall and real steps take 10-100x longer.
The load average at the start and the end is printed and written to the JSON.

    python scripts/sim_vs_runtime.py --model tiny                       # hit-rate check, seconds
    python scripts/sim_vs_runtime.py --calibration artifacts/bench_model.json     # SmolLM2-135M, minutes
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path

from sgl_lite.bench.artifacts import artifact_path, output_file
from sgl_lite.bench.workloads import Vocabulary, multiturn_agent
from sgl_lite.runtime.server.core import RuntimeCore
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.sim.cost_model import CostModel
from sgl_lite.sim.simulator import RequestResult, SimResult, replay, simulate, summarize
from sgl_lite.sim.trace import from_workload


def run_real(core: RuntimeCore, sessions) -> SimResult:
    sched = core.scheduler
    offset = time.monotonic()  # session arrival times are relative to the start
    shifted = [s.__class__(s.session_id, s.arrival + offset, s.first_prompt, s.appendices, s.output_len, s.priority)
               for s in sessions]

    def wait_until(t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))

    start = time.monotonic()
    results: list[RequestResult] = replay(shifted, sched, time.monotonic, wait_until)
    span = time.monotonic() - start
    for r in results:  # back to times relative to the start, like the simulator's
        r.arrival -= offset
        r.first_token = None if r.first_token is None else r.first_token - offset
        r.finished = None if r.finished is None else r.finished - offset
    out = SimResult("real", results, span, span, sched.stats())
    out.summary = summarize(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model path or alias; 'tiny' builds a tiny random model")
    parser.add_argument("--policy", default="lpm")
    parser.add_argument("--calibration", default=None, help="scripts/bench_model.py JSON (default: built-in cost model)")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=math.inf)
    parser.add_argument("--max-running-requests", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (use bench_model.py's --threads for the calibration)")
    parser.add_argument("--out", default=artifact_path("sim_vs_runtime.json"))
    opts = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)

    model = opts.model
    if model == "tiny":
        from sgl_lite.testing.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    args = ServerArgs(model_path=model, schedule_policy=opts.policy, max_running_requests=opts.max_running_requests,
                      max_total_tokens=opts.max_total_tokens, device="cpu")
    core = RuntimeCore.from_args(args)
    vocab = Vocabulary.from_tokenizer(core.tokenizer, core.runner.vocab_size)
    workload = multiturn_agent(vocab, num_sessions=opts.sessions, num_turns=opts.turns,
                               system_prompt_len=opts.system_prompt_len, task_len=32, obs_len_min=16, obs_len_max=48,
                               output_len=opts.output_len, seed=1)
    sessions = from_workload(workload, opts.request_rate, seed=1)
    load_before = os.getloadavg()[0]
    real = run_real(core, sessions)
    cost = CostModel.from_bench_model_json(opts.calibration) if opts.calibration else CostModel.default()
    sim_args = args.replace(max_total_tokens=core.scheduler.num_slots,
                            max_running_requests=core.scheduler.max_running_requests)
    sim = simulate(sessions, sim_args, cost, policy=opts.policy, vocab_size=core.runner.vocab_size,
                   context_length=core.context_length)
    rows = [("cache hit rate", "cache_hit_rate"), ("output tok/s", "output_tokens_per_s"),
            ("makespan s", "makespan_s"), ("TTFT p50 s", "ttft_p50_s"), ("TTFT p99 s", "ttft_p99_s"),
            ("forward steps", "forward_steps"), ("retractions", "retractions")]
    load_after = os.getloadavg()[0]
    print(f"model {model}, policy {opts.policy}, cost model {cost.source}, "
          f"load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs\n")
    print("| metric | runtime | simulator | sim / runtime |\n|---|---:|---:|---:|")
    for label, key in rows:
        a, b = real.summary[key], sim.summary[key]
        ratio = f"{b / a:.2f}" if a else "-"
        print(f"| {label} | {a:.4g} | {b:.4g} | {ratio} |")
    output_file(opts.out).write_text(json.dumps({"model": model, "policy": opts.policy, "cost_model": cost.to_json(),
                                          "load_average": [load_before, load_after],
                                          "runtime": real.summary, "simulator": sim.summary}, indent=2))
    print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    main()
