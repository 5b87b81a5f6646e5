"""Decode steps with the weights and KV pool on 2 MiB pages against 4 KiB pages, in one process, interleaved.

Builds two ModelRunners of the default model with a server's KV pool (the default --max-total-tokens):
one as the server builds it (cpu_host/huge_pages.py advises huge pages under the weights and the
pool), one with that advice skipped. Each gets the same batch of requests with cached prefixes, then decode
steps are timed on the two in turn (each first in every other round), best of --repeats per round, on one
thread count (the governor off). Prints a table and writes JSON: the baseline (4 KiB pages) is measured in
the same run.

Usage: python scripts/ab_huge_pages.py [--quantization w8a8_int8] [--batch 8] [--prefix 450] [--steps 10]
       [--rounds 4] [--repeats 3] [--out artifacts/ab_huge_pages.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from runner_bench import RunnerBench  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.runtime.model_executor import model_runner  # noqa: E402
from sgl_lite.runtime.model_executor.loader import resolve_model_path  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402


def build(huge: bool, args: argparse.Namespace, model_dir: Path) -> model_runner.ModelRunner:
    advise = model_runner.advise_huge_pages
    if not huge:
        model_runner.advise_huge_pages = lambda tensors, written: 0
    try:
        return model_runner.ModelRunner(ServerArgs(model_path=str(model_dir), device="cpu", quantization=args.quantization,
                                                   disable_adaptive_threads=True), model_dir=model_dir)
    finally:
        model_runner.advise_huge_pages = advise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="w8a8_int8")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=450)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=artifact_path("ab_huge_pages.json"))
    args = parser.parse_args()
    model_dir = resolve_model_path("smollm2-135m")
    benches = {name: RunnerBench(build(name == "2 MiB pages", args, model_dir)) for name in ("4 KiB pages", "2 MiB pages")}
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prefix + args.steps + 1)] for _ in range(args.batch)]

    def run(bench: RunnerBench) -> float:
        reqs = bench._reqs(prompts)
        bench._step(reqs, [args.prefix] * args.batch)
        start = time.perf_counter()
        for _ in range(args.steps):
            bench._step(reqs, [1] * args.batch)
        seconds = time.perf_counter() - start
        bench._release(reqs)
        return 1000 * seconds / args.steps

    for bench in benches.values():
        run(bench)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in benches}
    names = list(benches)
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            times[name].append(min(run(benches[name]) for _ in range(args.repeats)))
    base = statistics.median(times["4 KiB pages"])
    print(f"\ndecode steps of {args.batch} on {args.prefix} cached tokens, quantization {args.quantization}: ms per step, "
          f"best of {args.repeats} per round\n")
    print("| pages | rounds | median | vs 4 KiB |")
    print("|---|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {' / '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} | "
              f"{base / statistics.median(values):.3f}x |")
    out = output_file(args.out)
    out.write_text(json.dumps({"args": vars(args), "ms_per_step": times}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
