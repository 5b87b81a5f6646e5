"""Where a forward's time goes, op by op: an agent turn's extend step and decode steps on the default model.

Builds a ModelRunner (bf16 by default, the server's kernels and dispatch), gives B requests a cached
prefix of --prefix random tokens, then times either one extend step of --new tokens per request (an agent
turn: the observation and the next prompt on top of the conversation) or --decode-steps decode steps on
top of the prefix (with --draft K, speculative steps: each request verifies K draft tokens). Best of --repeats, then one more run under torch.profiler, whose table of ops by self
CPU time is printed: what share the matmuls (`mkldnn::_linear_pointwise`: oneDNN; `sgl_lite::bf16_gemv`,
`w8a8_gemm`: the C++ kernels), attention (`sgl_lite::extend_attention`, `paged_decode_attention`) and
the rest take. A diagnostic, not a benchmark: no baseline, and the shares move with the host's load.
Usage: python scripts/profile_step.py [extend|decode] [--batch 8] [--prefix 450] [--new 90] [--draft 8]
       [--quantization w8a8_int8] [--kv-cache-dtype fp8_e4m3] [--dtype bf16] [--rows 12] [--out artifacts/profile_step.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from runner_bench import DTYPE_FLAGS, RunnerBench  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.runtime.model_executor.loader import resolve_model_path  # noqa: E402
from sgl_lite.runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=["extend", "decode"], nargs="?", default="extend")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", choices=sorted(DTYPE_FLAGS), default="bf16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8_e4m3 or fp8_e5m2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=450, help="cached tokens per request before the timed step")
    parser.add_argument("--new", type=int, default=90, help="extend: new tokens per request")
    parser.add_argument("--decode-steps", type=int, default=10)
    parser.add_argument("--draft", type=int, default=0,
                        help="decode: each step verifies this many random draft tokens per request (speculative steps)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=12, help="ops shown")
    parser.add_argument("--out", default=artifact_path("profile_step.json"))
    args = parser.parse_args()

    model_dir = resolve_model_path(args.model)
    context = args.prefix + max(args.new, args.decode_steps) + 1 + args.draft
    runner = ModelRunner(ServerArgs(model_path=str(model_dir), dtype=DTYPE_FLAGS[args.dtype], device="cpu",
                                    quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, max_total_tokens=args.batch * context + 64,
                                    max_running_requests=args.batch + 1), model_dir=model_dir)
    bench = RunnerBench(runner)
    rng = random.Random(0)

    def run_once(profiler: torch.profiler.profile | None = None) -> float:
        reqs = bench._reqs([[rng.randrange(1000, 40000) for _ in range(context)] for _ in range(args.batch)])
        bench._step(reqs, [args.prefix] * args.batch)
        if profiler is not None:
            profiler.start()
        start = time.perf_counter()
        if args.phase == "extend":
            bench._step(reqs, [args.new] * args.batch)
        else:
            for _ in range(args.decode_steps):
                if args.draft:
                    bench._verify_step(reqs, args.draft, rng)
                else:
                    bench._step(reqs, [1] * args.batch)
        seconds = time.perf_counter() - start
        if profiler is not None:
            profiler.stop()
        bench._release(reqs)
        return seconds

    run_once()  # warm-up: first touches of the pool, the thread governor's first verdicts
    best = min(run_once() for _ in range(args.repeats))
    profiler = torch.profiler.profile()
    run_once(profiler)
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    steps = 1 if args.phase == "extend" else args.decode_steps
    what = f"{args.batch} x {args.new} new tokens" if args.phase == "extend" else f"{steps} decode steps of {args.batch}"
    if args.phase == "decode" and args.draft:
        what += f", each request verifying {args.draft} draft tokens a step"
    print(f"\n{args.phase}: {what} on {args.prefix} cached tokens each, {runner.dtype}, "
          f"quantization {args.quantization or 'none'}, KV cache {args.kv_cache_dtype}: best {1000 * best / steps:.2f} ms per step of {args.repeats}\n")
    print("| op | self CPU ms per step | share | calls per step |")
    print("|---|---:|---:|---:|")
    rows = []
    for e in events[: args.rows]:
        rows.append({"op": e.key, "ms_per_step": e.self_cpu_time_total / 1000 / steps,
                     "share": e.self_cpu_time_total / total, "calls_per_step": e.count / steps})
        print(f"| {e.key} | {rows[-1]['ms_per_step']:.2f} | {100 * rows[-1]['share']:.1f}% | {rows[-1]['calls_per_step']:.0f} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"phase": args.phase, "batch": args.batch, "prefix": args.prefix, "new": args.new, "draft": args.draft,
                               "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype, "dtype": str(runner.dtype),
                               "best_ms_per_step": 1000 * best / steps, "ops": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
