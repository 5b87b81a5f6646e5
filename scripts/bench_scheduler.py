"""Cost of one scheduling round (policy ordering + prefill admission) against the waiting-queue length.

For each policy and each queue length N, the waiting queue is kept at N requests (each admitted
request is replaced by a fresh one) while rounds run with the deterministic fake runner of the
tests. Prompts share one of 32 cached prefixes (64-256 tokens) plus a random 16-64-token suffix, and
max_new_tokens=1, so every step is a prefill round admitting up to --max-running requests.
lpm and dfs-weight run three ways in the same run: incremental (the default: the waiting index
follows the tree, a step reads only the head of the order), rescan (SGLang's way: every waiting
request re-matched each step, --disable-incremental-ordering) and rescan with SGLang's fallback to
fcfs above 128 waiting requests.

    python scripts/bench_scheduler.py [--sizes 128 1000 10000] [--rounds 10] [--cpu-time] [--out artifacts/bench_scheduler.json]

--cpu-time measures this thread's CPU time instead of wall time: on a shared box, other processes
then do not inflate the numbers (wall time is the default, as the runtime experiences it).

Prints a table of microseconds per round: ordering alone (the policy), ordering + admission, and
the whole step (fake forward and output processing included); writes JSON, plus a PNG plot when
matplotlib is importable.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fake_runner import FakeRunner  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.runtime.managers.request import Req  # noqa: E402
from sgl_lite.runtime.managers.scheduler import Scheduler  # noqa: E402
from sgl_lite.runtime.protocol import SamplingParams  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

VOCAB = 32000
timer = time.perf_counter  # main() may switch to time.thread_time (--cpu-time)
NUM_PREFIXES = 32
RESCAN = {"disable_incremental_ordering": True}
CONFIGS = [
    ("fcfs", {}), ("lof", {}), ("random", {}),
    ("lpm (incremental)", {}), ("lpm (rescan)", RESCAN),
    ("lpm (rescan, fallback 128)", {**RESCAN, "lpm_fallback_threshold": 128}),
    ("dfs-weight (incremental)", {}), ("dfs-weight (rescan)", RESCAN),
    ("dfs-weight (rescan, fallback 128)", {**RESCAN, "lpm_fallback_threshold": 128}),
]


class Workload:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(2, VOCAB) for _ in range(self.rng.randrange(64, 257))] for _ in range(NUM_PREFIXES)]
        self.count = 0

    def request(self) -> Req:
        suffix = [self.rng.randrange(2, VOCAB) for _ in range(self.rng.randrange(16, 65))]
        self.count += 1
        params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        return Req(f"b{self.count}", self.rng.choice(self.prefixes) + suffix, params, arrival_time=float(self.count))


def bench_one(policy: str, extra: dict, num_waiting: int, rounds: int, max_running: int) -> dict:
    runner = FakeRunner(num_slots=2_000_000, max_running_requests=max_running, context_length=512,
                        vocab_size=VOCAB, record=False, check_kv=False)
    args = ServerArgs(schedule_policy=policy.split(" ")[0], max_running_requests=max_running, random_seed=0,
                      chunked_prefill_size=-1, **extra)
    sched = Scheduler(args, runner, eos_token_ids=(), context_length=512)
    work = Workload(seed=1)
    for prefix in work.prefixes:  # warm the cache with every shared prefix
        slots = sched.kv.allocator.alloc(len(prefix))
        sched.kv.tree_cache.insert(prefix, slots)
    for _ in range(num_waiting):
        sched.add_request(work.request())

    timed: list[float] = []
    ordering: list[float] = []
    original = sched._prefill_batch
    original_candidates = sched.policy.candidates

    def timed_prefill():
        start = timer()
        batch = original()
        timed.append(timer() - start)
        return batch

    def timed_candidates(*a, **k):
        start = timer()
        out = original_candidates(*a, **k)
        ordering.append(timer() - start)
        return out

    sched._prefill_batch = timed_prefill  # type: ignore[method-assign]
    sched.policy.candidates = timed_candidates  # type: ignore[method-assign]
    step_times: list[float] = []
    admitted: list[int] = []
    for _ in range(rounds):
        before = sched.num_waiting()
        start = timer()
        sched.step()
        step_times.append(timer() - start)
        admitted.append(before - sched.num_waiting())
        for _ in range(num_waiting - sched.num_waiting()):
            sched.add_request(work.request())
    sched.check_invariant()
    return {
        "policy": policy,
        "num_waiting": num_waiting,
        "active_policy": sched.policy.active_policy(num_waiting) + ("+index" if sched.policy.index is not None else ""),
        "order_us_median": statistics.median(ordering) * 1e6,
        "schedule_us_median": statistics.median(timed) * 1e6,
        "step_us_median": statistics.median(step_times) * 1e6,
        "admitted_per_round": statistics.mean(admitted),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 1000, 10000])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--cpu-time", action="store_true", help="time with this thread's CPU clock instead of wall time")
    parser.add_argument("--out", default=artifact_path("bench_scheduler.json"))
    opts = parser.parse_args()
    global timer
    timer = time.thread_time if opts.cpu_time else time.perf_counter

    results = []
    print(f"{'policy':<34}{'waiting':>9}{'active':>18}{'order us':>11}{'sched us':>11}{'step us':>11}{'admitted':>10}")
    for policy, extra in CONFIGS:
        for n in opts.sizes:
            r = bench_one(policy, extra, n, opts.rounds, opts.max_running)
            results.append(r)
            print(f"{policy:<34}{n:>9}{r['active_policy']:>18}{r['order_us_median']:>11.0f}{r['schedule_us_median']:>11.0f}"
                  f"{r['step_us_median']:>11.0f}{r['admitted_per_round']:>10.1f}", flush=True)
    output_file(opts.out).write_text(json.dumps({"max_running": opts.max_running, "load_average": os.getloadavg()[0],
                                          "clock": "thread CPU time" if opts.cpu_time else "wall time",
                                          "results": results}, indent=2))
    print(f"wrote {opts.out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, _ in CONFIGS:
        rows = [r for r in results if r["policy"] == policy]
        ax.plot([r["num_waiting"] for r in rows], [r["order_us_median"] for r in rows], marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("waiting requests")
    ax.set_ylabel("queue ordering per round (us, median)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    png = str(Path(opts.out).with_suffix(".png"))
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
