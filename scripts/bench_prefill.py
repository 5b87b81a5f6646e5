"""Prefill throughput on long extends over a cached prefix, against the matmul rate measured in the same run.

An agent's latency at a realistic model size is prefill: each turn extends a long cached conversation by
an observation or tool result of hundreds to thousands of tokens. For each variant (bf16, and a
--quantization such as w8a8_int8), one request's prefix of --prefix tokens is prefilled (untimed), then an
extend of each --extends length is timed (best of --repeats), through sgl_lite's ModelRunner as a served
step runs it (the runner's attention backend, matmul kernels and threads).

Next to each: the matmul limit, the tokens/s that the variant's own matmul kernels allow at that row count
(bench_model.matmul_limit: one layer's weights timed over and over, so an upper bound; attention FLOPs are
not part of it), and the bf16 variant's limit, the "bf16 GEMM rate" a quantized prefill is set against.
Variants run one after another (two 1.7B runners do not fit beside each other in memory), each with its
own limit measured right before it.

Prints a markdown table, writes JSON and a PNG (with matplotlib).
Usage: python scripts/bench_prefill.py [--model-path random-1.7b] [--variants bf16,w8a8_int8]
       [--prefix 3000] [--extends 500,2000] [--out artifacts/bench_prefill.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_model import matmul_limit  # noqa: E402
from runner_bench import RunnerBench  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, pyplot, save_png  # noqa: E402
from sgl_lite.runtime.layers.onednn import amx_matmuls  # noqa: E402
from sgl_lite.runtime.model_executor.loader import resolve_model_path  # noqa: E402
from sgl_lite.runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

PREFIX_CHUNK = 1024  # the untimed prefix goes in chunks of this many tokens, as chunked prefill would


def time_extend(bench: RunnerBench, ids: list[int], prefix: int, extend: int) -> float:
    """Seconds of one extend of `extend` tokens over a cached `prefix` (prefilled untimed first)."""
    reqs = bench._reqs([ids[: prefix + extend]])
    try:
        for start in range(0, prefix, PREFIX_CHUNK):
            bench._step(reqs, [min(PREFIX_CHUNK, prefix - start)])
        began = time.perf_counter()
        bench._step(reqs, [extend])
        return time.perf_counter() - began
    finally:
        bench._release(reqs)


def measure(model_dir: Path, variant: str, args: argparse.Namespace, ids: list[int], extends: list[int]) -> list[dict]:
    quantization = None if variant == "bf16" else variant
    pool = args.prefix + max(extends) + 64
    runner = ModelRunner(ServerArgs(model_path=str(model_dir), device="cpu", dtype="bfloat16", quantization=quantization,
                                    max_total_tokens=pool, max_running_requests=2), model_dir=model_dir)
    bench = RunnerBench(runner)
    time_extend(bench, ids, 0, 64)  # warm-up: packing, allocation, thread start
    forms = [dict(layer.packed) for layer in runner.model.layers], runner.model.packed_lm_head
    rows = []
    for extend in tqdm(extends, desc=variant):
        limit = matmul_limit(runner, forms, extend, with_lm_head=False, prefill=True)
        best = min(time_extend(bench, ids, args.prefix, extend) for _ in range(args.repeats))
        rows.append({"variant": variant, "prefix": args.prefix, "extend": extend, "tokens_per_s": extend / best,
                     "matmul_gflops": limit["gflops"], "matmul_limit": limit["tokens_per_s"]})
    del runner, bench
    gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="random-1.7b")
    parser.add_argument("--variants", default="bf16,w8a8_int8", help="bf16 and/or --quantization methods")
    parser.add_argument("--prefix", type=int, default=3000, help="cached tokens before each timed extend")
    parser.add_argument("--extends", default="500,2000", help="timed extend lengths")
    parser.add_argument("--repeats", type=int, default=2, help="each figure is the best of this many runs")
    parser.add_argument("--out", default=artifact_path("bench_prefill.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model_dir = resolve_model_path(args.model_path)
    extends = [int(e) for e in args.extends.split(",")]
    variants = args.variants.split(",")
    if variants[0] != "bf16":
        raise SystemExit("--variants must start with bf16: the others are set against its matmul rate")
    ids = torch.randint(3, 30000, (args.prefix + max(extends),), generator=torch.Generator().manual_seed(0)).tolist()
    rows = [row for variant in variants for row in measure(model_dir, variant, args, ids, extends)]
    bf16 = {r["extend"]: r for r in rows if r["variant"] == "bf16"}
    for r in rows:
        base = bf16[r["extend"]]
        r["vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["of_bf16_matmul_limit"] = r["tokens_per_s"] / base["matmul_limit"]
        r["of_own_matmul_limit"] = r["tokens_per_s"] / r["matmul_limit"]

    print(f"\nmodel {model_dir.name}, prefix {args.prefix} tokens cached, threads {torch.get_num_threads()}, AMX "
          f"{'yes' if amx_matmuls() else 'no'}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; best of {args.repeats}\n")
    print("| variant | extend | prefill tok/s | vs bf16 | matmul limit tok/s | / own matmul limit | / bf16 matmul limit | matmul GFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['extend']} | {r['tokens_per_s']:.1f} | {r['vs_bf16']:.2f}x | {r['matmul_limit']:.1f} | "
              f"{r['of_own_matmul_limit']:.0%} | {r['of_bf16_matmul_limit']:.0%} | {r['matmul_gflops']:.0f} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"model": str(model_dir), "amx": amx_matmuls(), "load_average": os.getloadavg()[0],
                               "args": vars(args), "results": rows}, indent=2))
    print(f"\nwrote {out}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['variant']}\n+{r['extend']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["tokens_per_s"] for r in rows], width=0.4, label="prefill tok/s")
    ax.bar([x + 0.2 for x in xs], [r["matmul_limit"] for r in rows], width=0.4, label="matmul limit")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"extends over a {args.prefix}-token cached prefix, {model_dir.name}")
    ax.legend()
    save_png(fig, out)


if __name__ == "__main__":
    main()
