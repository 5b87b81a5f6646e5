"""Where a served agent run's time goes: every forward of `sgl-lite serve` timed while the workload runs.

Starts `sgl-lite serve` (with --serve-args) in a child process whose `ModelRunner.forward` records each
forward (start, end, kind, requests, tokens, tokens emitted; the kind is prefill, decode, or verify: a
decode step in which some rows verify n-gram drafts), warms it up with one session, then drives it with
bench_peers.py's workload (`sgl-lite bench`'s multi-turn agent over streaming OpenAI chat, --sessions
sessions) and prints: the run's span and the time spent in forwards, the prefill batches (requests, tokens,
ms, tok/s), decode steps by batch size (count, how many verified drafts, mean and least ms, tokens emitted
per step) and the time between forwards (the scheduler's own work, and waits for the next turn's requests). A diagnostic like profile_step.py: no
baseline, and on a shared box the split moves with the load. Writes JSON.

Usage: python scripts/profile_serving.py [--sessions 8] [--serve-args "--quantization w8a8_int8"] [--out artifacts/profile_serving.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_peers import _wait_ready, bench  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402

PORT = 30195
# Run in the child: wrap ModelRunner.forward, write the records to $TRACE on SIGUSR1, then serve as the CLI does.
CHILD = """
import json, os, signal, sys, time
import torch
from sgl_lite.runtime.model_executor import model_runner
records, forward = [], model_runner.ModelRunner.forward
def timed(self, batch):
    start = time.perf_counter()
    out = forward(self, batch)
    drafts = batch.draft_ids or [[] for _ in batch.reqs]
    # a decode step: every row computes one token of its own (and a verifying row its draft after it)
    step = all(e - len(d) == 1 for e, d in zip(batch.extend_lens, drafts))
    kind = ("verify" if any(drafts) else "decode") if step else "prefill"
    emitted = sum(len(a) if a else t is not None for a, t in zip(out.accepted_ids or [None] * len(drafts), out.next_token_ids))
    records.append((start, time.perf_counter(), kind, len(batch.reqs), batch.num_tokens, emitted, torch.get_num_threads()))
    return out
model_runner.ModelRunner.forward = timed
signal.signal(signal.SIGUSR1, lambda *_: open(os.environ["TRACE"], "w").write(json.dumps(records)))
from sgl_lite.cli import main
sys.argv = ["sgl-lite", *sys.argv[1:]]
main()
"""


def records(proc: subprocess.Popen, trace: Path) -> list[list]:
    """The child's records so far (it writes them when signalled)."""
    trace.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            return json.loads(trace.read_text())
        except (OSError, ValueError):  # not written yet, or half written
            time.sleep(0.1)
    raise TimeoutError("the server did not write its forward records")


def summarize(forwards: list[list]) -> dict:
    prefill = [f for f in forwards if f[2] == "prefill"]
    steps = [f for f in forwards if f[2] != "prefill"]  # decode steps, verifying drafts or not
    by_batch: dict[int, list[list]] = defaultdict(list)
    for start, end, kind, reqs, _, emitted, _ in steps:
        by_batch[reqs].append([1e3 * (end - start), kind == "verify", emitted])
    gaps = [forwards[i + 1][0] - forwards[i][1] for i in range(len(forwards) - 1)]
    return {
        "span_s": forwards[-1][1] - forwards[0][0],
        "forward_s": sum(end - start for start, end, *_ in forwards),
        "prefill": [{"requests": reqs, "tokens": tokens, "ms": 1e3 * (end - start), "tok_s": tokens / (end - start), "threads": threads}
                    for start, end, _, reqs, tokens, _, threads in prefill],
        "decode": [{"batch": b, "steps": len(rows), "verifying": sum(v for _, v, _ in rows),
                    "mean_ms": statistics.fmean(ms for ms, _, _ in rows), "least_ms": min(ms for ms, _, _ in rows),
                    "tokens_per_step": statistics.fmean(e for _, _, e in rows)} for b, rows in sorted(by_batch.items())],
        "between_forwards_s": sum(gaps), "longest_gap_ms": 1e3 * max(gaps, default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--serve-args", default="", help="extra `sgl-lite serve` flags, one string")
    parser.add_argument("--out", default=artifact_path("profile_serving.json"))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="profile_serving-"))
    trace, log = workdir / "forwards.json", workdir / "serve.log"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "serve", "--port", str(PORT), *shlex.split(args.serve_args)],
                            env={**os.environ, "TRACE": str(trace)}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{PORT}"
        if not _wait_ready(url, 300):
            raise SystemExit(f"the server did not come up; see {log}")
        bench(url, 1, workdir, proc.pid)  # warm-up: first requests pay one-time costs
        warm = len(records(proc, trace))
        served = bench(url, args.sessions, workdir, proc.pid)
        forwards = records(proc, trace)[warm:]
        summary = summarize(forwards)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    prefill_s = sum(p["ms"] for p in summary["prefill"]) / 1e3
    decode_s = sum(d["steps"] * d["mean_ms"] for d in summary["decode"]) / 1e3
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, `sgl-lite serve {args.serve_args}`, {args.sessions} sessions: "
          f"{served['output_tok_s']:.1f} output tok/s\n")
    print("| | seconds | share of the span |\n|---|---:|---:|")
    for name, seconds in (("span (first forward's start to last one's end)", summary["span_s"]), ("in forwards", summary["forward_s"]),
                          ("prefill forwards", prefill_s), ("decode forwards", decode_s), ("between forwards", summary["between_forwards_s"])):
        print(f"| {name} | {seconds:.2f} | {seconds / summary['span_s']:.0%} |")
    print("\n| prefill batch | requests | tokens | threads | ms | tok/s |\n|---:|---:|---:|---:|---:|---:|")
    for i, p in enumerate(summary["prefill"]):
        print(f"| {i + 1} | {p['requests']} | {p['tokens']} | {p['threads']} | {p['ms']:.0f} | {p['tok_s']:.0f} |")
    print("\n| decode batch | steps | of them verifying drafts | mean ms | least ms | tokens per step |\n|---:|---:|---:|---:|---:|---:|")
    for d in summary["decode"]:
        print(f"| {d['batch']} | {d['steps']} | {d['verifying']} | {d['mean_ms']:.1f} | {d['least_ms']:.1f} | {d['tokens_per_step']:.2f} |")
    out = output_file(args.out)
    # the raw records too ([start, end, kind, requests, tokens, tokens emitted, threads], perf_counter seconds): per-step timelines
    out.write_text(json.dumps({"time": time.time(), "args": vars(args), "served": served, **summary, "forwards": forwards}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
