"""Where a decode step's wall time goes: the REAL Scheduler + ModelRunner on the default model.

For each batch size B (default 32, 8, 1) it queues B requests (random prompt ids, greedy,
ignore_eos), steps the scheduler until all of them are decoding, then times `--steps` decode steps
and splits each step's wall time into:

- scheduler: everything in `Scheduler.step()` outside `runner.forward` (admission check, batch
  building and slot allocation, appending tokens, stop checks);
- runner prep: inside `runner.forward` but outside the model, LM head and sampler (input ids,
  attention metadata, positions, backend `prepare`, output lists);
- model: the decoder layers (`model.forward`), LM head: `compute_logits`, sampling: `sampler.sample`.

The phases are timed by wrapping those bound methods on this process's objects (no hooks in the
runtime, nothing changes when this script is not running). Baseline measured in the same run: the
same decode batch driven directly (model + LM head + argmax on tensors built once), i.e. the step
time if scheduling and preparation were free.

With --device cuda (scripts/gpu/device_check.sh runs it) each timed phase ends with a device synchronisation,
so the GPU's work counts in the phase that queued it, and "scheduler" + "runner prep" are the host's gap between
forwards; a decode step replayed from a CUDA graph counts as "model" (its LM head inside the graph), and the
baseline replays the same graph.

Prints a markdown table, writes JSON and a PNG (stacked bars) when matplotlib is installed.
`--profile-batch B` also runs torch.profiler over a few steps at batch B and prints its top ops
(a cross-check of the timers: the scheduler's Python shows up as time outside any torch op).
Usage: python scripts/bench_step.py [--batch-sizes 32,8,1] [--steps 32] [--prompt-len 128] [--out artifacts/bench_step.json] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, pyplot, save_png  # noqa: E402
from sgl_lite.runtime.model_executor import loader  # noqa: E402
from sgl_lite.runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_lite.runtime.server.core import RuntimeCore, eos_ids_of  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

PHASES = ("scheduler", "runner prep", "model", "LM head", "sampling")


class PhaseTimer:
    """Accumulates wall time per named phase; `wrap` times one bound method of one object."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.synchronize = synchronize  # CUDA: the phase's queued GPU work finishes inside the phase

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        inner: Callable = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                out = inner(*args, **kwargs)
                if self.synchronize is not None:
                    self.synchronize()
                return out
            finally:
                self.totals[phase] += time.perf_counter() - start

        setattr(obj, method, timed)  # instance attribute: shadows the class method for this object only

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


def build_core(model: str, dtype: str, pool_tokens: int, max_running: int, quantization: str | None = None,
               device: str = "cpu") -> RuntimeCore:
    folder = loader.resolve_model_path(model)
    args = ServerArgs(model_path=model, dtype=dtype, device=device, max_total_tokens=pool_tokens,
                      max_running_requests=max_running, quantization=quantization)
    tokenizer = loader.load_tokenizer(folder)
    runner = ModelRunner(args, folder)
    return RuntimeCore(args, tokenizer, runner, str(folder), eos_ids_of(runner.config, tokenizer))


def measure_batch(core: RuntimeCore, timer: PhaseTimer, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    sched, runner = core.scheduler, core.runner
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        ids = torch.randint(3, runner.vocab_size, (prompt_len,), generator=g).tolist()
        req = core.make_req(f"b{batch}-{i}", None, ids, {"max_new_tokens": steps + 8, "temperature": 0.0, "ignore_eos": True})
        sched.add_request(req)
    while len(sched.running) < batch:  # prefill (and the first token) of every request
        sched.step()
    for _ in range(2):  # warm-up decode steps
        sched.step()
    timer.take()
    per_step: list[dict[str, float]] = []
    for _ in range(steps):
        start = time.perf_counter()
        sched.step()
        wall = time.perf_counter() - start
        t = timer.take()
        inside = t.get("model", 0.0) + t.get("LM head", 0.0) + t.get("sampling", 0.0)
        per_step.append({"wall": wall, "scheduler": wall - t["forward"], "runner prep": t["forward"] - inside,
                         "model": t.get("model", 0.0), "LM head": t.get("LM head", 0.0), "sampling": t.get("sampling", 0.0)})
    while sched.has_work():  # drain: frees every slot and row for the next batch size
        sched.step()
    sched.check_invariant()
    return {key: statistics.median(s[key] for s in per_step) for key in ("wall", *PHASES)} | {"steps": steps}


@torch.inference_mode()
def measure_baseline(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> float:
    """Median time of model + LM head + argmax for `batch` decode tokens, inputs and metadata built once."""
    from sgl_lite.runtime.layers.attention import AttentionMetadata
    from sgl_lite.runtime.mem_cache.memory_pool import SlotAllocator

    alloc = SlotAllocator(runner.num_slots)
    rows = [runner.req_to_token.alloc() for _ in range(batch)]
    kv_len = prompt_len + steps // 2  # the middle of the measured window's KV lengths
    slots = alloc.alloc(batch * (kv_len + 1))
    for i, row in enumerate(rows):  # slots hold stale KV: attention cost does not depend on the values
        runner.req_to_token.table[row, : kv_len + 1] = slots[i * (kv_len + 1) : (i + 1) * (kv_len + 1)]
    out_loc = runner.req_to_token.table[rows, kv_len].clone()
    meta = AttentionMetadata.build(rows, [kv_len] * batch, [1] * batch, out_loc, runner.req_to_token)
    input_ids = torch.randint(3, runner.vocab_size, (batch,), device=runner.device)
    positions = torch.full((batch,), kv_len, dtype=torch.int64, device=runner.device)
    graphs = runner.graph_runner if runner.graph_runner is not None and runner.graph_runner.bucket_for(batch) else None
    runner.attn.prepare(meta)
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        if graphs is not None:
            logits = graphs.replay(input_ids, positions, meta)
        else:
            logits = runner.model.compute_logits(runner.model(input_ids, positions, runner.attn, runner.kv_pool))
        logits.argmax(dim=-1).tolist()
        times.append(time.perf_counter() - start)
    for row in rows:
        runner.req_to_token.free(row)
    return statistics.median(times[2:])


def profile_steps(core: RuntimeCore, batch: int, prompt_len: int, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    sched = core.scheduler
    for i in range(batch):
        ids = torch.randint(3, core.runner.vocab_size, (prompt_len,)).tolist()
        sched.add_request(core.make_req(f"p{i}", None, ids, {"max_new_tokens": steps + 8, "temperature": 0.0, "ignore_eos": True}))
    while len(sched.running) < batch:
        sched.step()
    sched.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            sched.step()
        wall = time.perf_counter() - start
    while sched.has_work():
        sched.step()
    print(f"\ntorch.profiler, batch {batch}, {steps} decode steps, {wall / steps * 1e3:.1f} ms/step (profiler on)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="32,8,1")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size (medians are reported)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quantization", default=None, help="as `sgl-lite serve --quantization`")
    parser.add_argument("--profile-batch", type=int, default=None, help="also run torch.profiler at this batch size")
    parser.add_argument("--out", default=artifact_path("bench_step.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    biggest = max(batch_sizes + [args.profile_batch or 0])
    pool = biggest * (args.prompt_len + args.steps + 16) * 2 + 64
    core = build_core(args.model, args.dtype, pool, biggest + 1, args.quantization, args.device)
    runner = core.runner
    timer = PhaseTimer(torch.cuda.synchronize if args.device == "cuda" else None)
    timer.wrap(runner, "forward", "forward")
    timer.wrap(runner.model, "forward", "model")  # nn.Module.__call__ looks up self.forward: the wrapper runs
    if runner.graph_runner is not None:
        timer.wrap(runner.graph_runner, "replay", "model")
    timer.wrap(runner.model, "compute_logits", "LM head")
    timer.wrap(runner.sampler, "sample", "sampling")

    rows = []
    for batch in tqdm(batch_sizes, desc="bench_step"):
        row = measure_batch(core, timer, batch, args.prompt_len, args.steps, seed=batch)
        row["batch"] = batch
        row["baseline"] = measure_baseline(runner, batch, args.prompt_len, args.steps)
        rows.append(row)

    load = os.getloadavg()[0]
    print(f"\nload average {load:.1f} on {os.cpu_count()} CPUs; dtype {str(runner.dtype).removeprefix('torch.')}, "
          f"threads {torch.get_num_threads()}, prompt {args.prompt_len} tok, median of {args.steps} decode steps (ms)\n")
    print("| batch | step | scheduler | runner prep | model | LM head | sampling | sched+prep share | baseline (model+head+argmax) | step / baseline | tok/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = (r["scheduler"] + r["runner prep"]) / r["wall"]
        r["sched_prep_share"] = share
        print(f"| {r['batch']} | {r['wall'] * 1e3:.1f} | " + " | ".join(f"{r[p] * 1e3:.2f}" for p in PHASES)
              + f" | {share:.1%} | {r['baseline'] * 1e3:.1f} | {r['wall'] / r['baseline']:.2f}x | {r['batch'] / r['wall']:.0f} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"load_average": load, "dtype": str(runner.dtype), "threads": torch.get_num_threads(),
                               "args": vars(args), "results": rows}, indent=2))
    print(f"\nwrote {out}")
    if args.profile_batch:
        profile_steps(core, args.profile_batch, args.prompt_len, 8)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"b{r['batch']}" for r in rows]
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        values = [r[phase] * 1e3 for r in rows]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(labels, [r["baseline"] * 1e3 for r in rows], color="black", marker="_", s=400, label="baseline", zorder=3)
    ax.set_ylabel("ms per decode step (median)")
    ax.legend()
    save_png(fig, out)


if __name__ == "__main__":
    main()
