"""Decode throughput under thread settings, with and without a busy neighbour process (a shared box).

Each measurement is a fresh process (OpenMP reads its environment once, at start-up) that loads the model
and times `--steps` decode steps at batch `--batch` with the cpu_kernel backend (best of 2 windows).
Settings: the adaptive thread count `sgl-lite serve` uses by default (1 or all threads per batch size,
chosen by timing both: cpu_host/thread_governor.py), and fixed counts: all threads with OpenMP's
default wait policy (spin at every barrier before sleeping) or OMP_WAIT_POLICY=passive (sleep at once),
and 1 thread. Neighbours: none, `python -c "while 1: pass"`
unpinned, and the same pinned to the last core. Every (neighbour, setting) pair is measured in each round,
settings interleaved, so that other load on the box falls on all of them alike.

Usage: python scripts/bench_threads.py [--batch 8] [--steps 16] [--rounds 1] [--out bench_threads.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402

SETTINGS = {  # name -> (torch threads, extra environment, adaptive threads)
    "adaptive (serve's default)": (2, {}, True),
    "2 threads, OMP default": (2, {}, False),
    "2 threads, OMP_WAIT_POLICY=passive": (2, {"OMP_WAIT_POLICY": "passive"}, False),
    "1 thread": (1, {}, False),
}
NEIGHBOURS = ("none", "busy, unpinned", "busy, pinned to last core")


def worker(batch: int, steps: int, prompt_len: int, adaptive: bool) -> None:
    import logging

    import torch  # libgomp reads OMP_WAIT_POLICY when torch loads it

    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT))
    from runner_bench import RunnerBench

    from sgl_lite.runtime.model_executor.loader import resolve_model_path
    from sgl_lite.runtime.model_executor.model_runner import ModelRunner
    from sgl_lite.runtime.server_args import ServerArgs

    logging.basicConfig(level=logging.WARNING)
    model_dir = resolve_model_path("smollm2-135m")
    runner = ModelRunner(ServerArgs(model_path=str(model_dir), device="cpu", attention_backend="cpu_kernel",
                                    max_total_tokens=batch * (prompt_len + 2 * steps + 4) + 64, max_running_requests=batch + 1,
                                    disable_adaptive_threads=not adaptive),
                         model_dir=model_dir)
    prompts = torch.randint(3, runner.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    print(json.dumps({"tokens_per_s": RunnerBench(runner).decode(prompts, steps, 2), "threads": torch.get_num_threads()}))


def start_neighbour(kind: str) -> subprocess.Popen | None:
    if kind == "none":
        return None
    pin = kind.endswith("core")
    cpus = sorted(os.sched_getaffinity(0))
    return subprocess.Popen([sys.executable, "-c", "while 1: pass"],
                            preexec_fn=(lambda: os.sched_setaffinity(0, {cpus[-1]})) if pin else None)


def measure(setting: str, args: argparse.Namespace) -> float:
    threads, extra, adaptive = SETTINGS[setting]
    env = {**os.environ, **extra, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, __file__, "--worker", "--batch", str(args.batch), "--steps", str(args.steps),
                          "--prompt-len", str(args.prompt_len)] + (["--adaptive"] if adaptive else []), env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--adaptive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=artifact_path("bench_threads.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.batch, args.steps, args.prompt_len, args.adaptive)
        return
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for neighbour in NEIGHBOURS:
            proc = start_neighbour(neighbour)
            try:
                for setting in SETTINGS:
                    tps = measure(setting, args)
                    best[neighbour, setting] = max(best.get((neighbour, setting), 0.0), tps)
                    print(f"{neighbour:26} {setting:36} {tps:7.1f} tok/s", flush=True)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    load = os.getloadavg()[0]
    print(f"\nload average {load:.1f} on {os.cpu_count()} CPUs; decode batch {args.batch}, {args.steps} steps, best of "
          f"{args.rounds} round(s) x 2 windows (tokens/s; in parentheses: share of the same setting without a neighbour)\n")
    print("| setting | " + " | ".join(NEIGHBOURS) + " |")
    print("|---|" + "---:|" * len(NEIGHBOURS))
    for setting in SETTINGS:
        base = best["none", setting]
        cells = [f"{best[n, setting]:.1f} ({best[n, setting] / base:.0%})" for n in NEIGHBOURS]
        print(f"| {setting} | " + " | ".join(cells) + " |")
    output_file(args.out).write_text(json.dumps({"load_average": load, "args": vars(args), "time": time.time(),
                                          "results": [{"neighbour": n, "setting": s, "tokens_per_s": v} for (n, s), v in best.items()]},
                                         indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
