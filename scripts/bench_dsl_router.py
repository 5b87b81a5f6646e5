"""sgl_lite's DSL agent programs on one replica and through sglang-router over `--dp-size N` replicas, in one run.

The workload: `sgl_lite.demo_agent.react_agent` (the ReAct agent of `sgl-lite demo`), one program per question,
all sharing its system prompt and few-shot example, each up to --max-turns turns (a thought, a regex-constrained
action, a tool result), greedy, run with `run_batch` on --concurrency threads. Each system gets
the same programs in each of --rounds rounds (its prefix cache flushed first); all systems are started before the
first round and stay up, idle while another is measured, and each round runs them one after another in a
rotated order:

- `replica`: one `sgl-lite serve` on every CPU of this process, `sgl.RuntimeEndpoint(replica URL)`, which speaks
  ZeroMQ to the runtime;
- `router-dpN`: what `sgl-lite serve --dp-size N` runs (N replicas, each on its own share of the CPUs, behind
  sglang-router with `cache_aware` routing), `sgl.RuntimeEndpoint(router URL)`, which speaks SGLang's HTTP protocol.

Reported per system: output tokens/s (the programs' completion tokens over the batch's wall time), the prefix-cache
hit rate seen by the programs (cached / prompt tokens over every gen's meta_info) and by the replicas (their
server_info counters, prefix hints included), requests and prompt tokens per replica, and how many answers equal the
first system's; then each system's throughput over the first's, same run.

Usage: python scripts/bench_dsl_router.py [--systems replica,router-dp2] [--programs 16] [--concurrency 8]
       [--max-turns 4] [--rounds 3] [--model-path smollm2-135m] [--out artifacts/bench_dsl_router.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, save_png  # noqa: E402
from sgl_lite.demo_agent import LOOKUP_TABLE, prompt_cache_stats, react_agent  # noqa: E402
from sgl_lite.lang.backend.runtime_endpoint import RuntimeEndpoint  # noqa: E402

COUNTERS = ("num_finished_requests", "prompt_tokens_total", "cached_tokens_total", "generated_tokens_total")
WARM_UP_QUESTION = "What is the boiling point of water in Fahrenheit?"


@dataclass
class System:
    """A started system: the endpoint the programs use, its replicas' HTTP URLs, and how to stop it."""
    name: str
    endpoint: RuntimeEndpoint
    worker_urls: list[str]
    stop: Callable[[], None]
    started_s: float = 0.0
    rounds: list[dict[str, Any]] = field(default_factory=list)


def questions(count: int) -> list[str]:
    """`count` distinct agent questions: each lookup key combined with a different arithmetic step."""
    keys = list(LOOKUP_TABLE)
    return [f"What is the {keys[i % len(keys)]}, multiplied by {2 + i // len(keys)}?" for i in range(count)]


def start_system(name: str, model_path: str) -> System:
    started = time.perf_counter()
    if name == "replica":
        from sgl_lite.lang.launcher import Runtime

        runtime = Runtime(model_path, log_level="warning")
        system = System(name, RuntimeEndpoint(runtime.url), [runtime.url], runtime.shutdown)
    else:
        from sgl_lite.cluster import Cluster, free_port
        from sgl_lite.runtime.server_args import ServerArgs

        match = re.fullmatch(r"router-dp(\d+)", name)
        if match is None:
            raise SystemExit(f"--systems: unknown system {name!r} (replica or router-dpN)")
        args = ServerArgs.from_kwargs(model_path=model_path, log_level="warning").replace(port=free_port())
        cluster = Cluster(args, int(match.group(1)), "cache_aware")
        cluster.start()
        system = System(name, RuntimeEndpoint(cluster.url), list(cluster.worker_urls), cluster.stop)
    system.started_s = time.perf_counter() - started
    print(f"{name}: ready in {system.started_s:.1f} s, the DSL speaks {system.endpoint.transport} "
          f"to {len(system.worker_urls)} replica(s)", flush=True)
    return system


def warm_up(system: System, max_turns: int) -> None:
    """One agent program on each replica directly (its first requests and grammars), then one through the system's
    own endpoint; the measured rounds flush the cache first, so none of this is a hit later."""
    for url in system.worker_urls:
        direct = RuntimeEndpoint(url)
        try:
            react_agent.run(WARM_UP_QUESTION, max_turns=max_turns, echo=_quiet, backend=direct, temperature=0)
        finally:
            direct.close()
    react_agent.run(WARM_UP_QUESTION, max_turns=max_turns, echo=_quiet, backend=system.endpoint, temperature=0)


def replica_counters(urls: list[str]) -> list[dict[str, int]]:
    return [{k: int(requests.get(url + "/server_info", timeout=60).json()[k]) for k in COUNTERS} for url in urls]


def completion_tokens(state: Any) -> int:
    metas = [state.get_meta_info(name) for name in list(state.stream_executor.meta_info)]
    return sum(m["completion_tokens"] for m in metas if isinstance(m, dict) and "completion_tokens" in m)


def run_round(system: System, agent: Any, batch: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    if not system.endpoint.flush_cache():
        raise RuntimeError(f"{system.name}: /flush_cache did not flush every replica")
    before = replica_counters(system.worker_urls)
    started = time.perf_counter()
    states = agent.run_batch(batch, backend=system.endpoint, temperature=0, num_threads=concurrency, progress_bar=True)
    wall = time.perf_counter() - started
    after = replica_counters(system.worker_urls)
    failed = [repr(s.error()) for s in states if s.error() is not None]
    done = [s for s in states if s.error() is None]
    if not done:
        raise RuntimeError(f"{system.name}: every program failed, e.g. {failed[0]}")
    cached, prompt = (sum(pair) for pair in zip(*(prompt_cache_stats(s) for s in done)))
    output = sum(completion_tokens(s) for s in done)
    per_replica = [{k: b[k] - a[k] for k in COUNTERS} for a, b in zip(before, after)]
    replica_prompt = sum(r["prompt_tokens_total"] for r in per_replica)
    return {"wall_s": wall, "output_tokens": output, "output_tok_s": output / wall,
            "programs_ok": len(done), "programs_failed": len(failed), "errors": failed[:3],
            "hit_rate_programs": cached / prompt if prompt else 0.0,
            "hit_rate_replicas": sum(r["cached_tokens_total"] for r in per_replica) / replica_prompt if replica_prompt else 0.0,
            "per_replica": per_replica, "answers": [s["answer"] if s.error() is None else None for s in states]}


def summarize(system: System, baseline_answers: list[Any] | None) -> dict[str, Any]:
    rounds = system.rounds
    last = rounds[-1]
    requests_total = [sum(r["per_replica"][i]["num_finished_requests"] for r in rounds) for i in range(len(system.worker_urls))]
    prompt_total = [sum(r["per_replica"][i]["prompt_tokens_total"] for r in rounds) for i in range(len(system.worker_urls))]
    answers = last["answers"]
    same = None if baseline_answers is None else sum(a == b for a, b in zip(answers, baseline_answers))
    return {"system": system.name, "transport": system.endpoint.transport, "startup_s": system.started_s,
            "output_tok_s": [r["output_tok_s"] for r in rounds],
            "output_tok_s_median": statistics.median(r["output_tok_s"] for r in rounds),
            "hit_rate_programs": [r["hit_rate_programs"] for r in rounds],
            "hit_rate_replicas": [r["hit_rate_replicas"] for r in rounds],
            "requests_per_replica": requests_total, "prompt_tokens_per_replica": prompt_total,
            "programs_failed": sum(r["programs_failed"] for r in rounds), "same_answers_as_first": same,
            "rounds": rounds}


def _quiet(_: str) -> None:
    pass


def _span(values: list[float], fmt: str) -> str:
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def print_table(summaries: list[dict[str, Any]], programs: int) -> None:
    print("\n| system | DSL speaks | out tok/s (rounds) | hit rate, programs | hit rate, replicas | requests per replica "
          "| prompt tokens per replica | failed | same answers | tok/s vs first |")
    print("|---|---|---:|---:|---:|---|---|---:|---:|---:|")
    first = summaries[0]["output_tok_s_median"]
    for s in summaries:
        share = sum(s["prompt_tokens_per_replica"]) or 1
        same = "-" if s["same_answers_as_first"] is None else f"{s['same_answers_as_first']}/{programs}"
        print(f"| {s['system']} | {s['transport']} | {_span(s['output_tok_s'], '.1f')} "
              f"| {_span([100 * h for h in s['hit_rate_programs']], '.1f')}% "
              f"| {_span([100 * h for h in s['hit_rate_replicas']], '.1f')}% "
              f"| {' / '.join(map(str, s['requests_per_replica']))} "
              f"| {' / '.join(f'{100 * p / share:.0f}%' for p in s['prompt_tokens_per_replica'])} "
              f"| {s['programs_failed']} | {same} | {s['output_tok_s_median'] / first:.2f}x |")


def plot(summaries: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, hits) = plt.subplots(1, 2, figsize=(9, 3.8))
    names = [s["system"] for s in summaries]
    for i, s in enumerate(summaries):
        speed.bar(i, s["output_tok_s_median"], color="tab:blue", alpha=0.6)
        speed.scatter([i] * len(s["output_tok_s"]), s["output_tok_s"], color="black", zorder=3, s=12)
        hits.bar([i - 0.2, i + 0.2], [100 * statistics.median(s["hit_rate_programs"]),
                                      100 * statistics.median(s["hit_rate_replicas"])],
                 width=0.4, color=["tab:green", "tab:olive"], label=["programs", "replicas"] if i == 0 else None)
    for ax in (speed, hits):
        ax.set_xticks(range(len(names)), names)
    speed.set_ylabel("output tokens/s (median; dots: rounds)")
    hits.set_ylabel("prefix-cache hit rate (%)")
    hits.set_ylim(0, 100)
    hits.legend(loc="lower right")
    save_png(fig, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="replica,router-dp2", help="comma-separated: replica, router-dpN")
    p.add_argument("--programs", type=int, default=16, help="agent programs (questions) per round")
    p.add_argument("--concurrency", type=int, default=8, help="run_batch threads")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--out", default=artifact_path("bench_dsl_router.json"))
    args = p.parse_args()
    if args.max_turns < 2 or args.programs < 2 or args.concurrency < 1 or args.rounds < 1:
        raise SystemExit("--max-turns and --programs must be >= 2, --concurrency and --rounds >= 1")
    # Bound, not per-program arguments: run_batch's prefix hint traces the program up to its first use of one.
    agent = react_agent.bind(max_turns=args.max_turns, echo=_quiet)
    batch = [{"question": q} for q in questions(args.programs)]
    print(f"{args.programs} agent programs x up to {args.max_turns} turns, {args.concurrency} at a time, "
          f"{args.rounds} round(s) per system, model {args.model_path}", flush=True)
    systems: list[System] = []
    try:
        for name in args.systems.split(","):
            systems.append(start_system(name.strip(), args.model_path))
            warm_up(systems[-1], args.max_turns)
        # Rounds interleave the systems, each round in a rotated order: this host's speed drifts within
        # minutes, and a system measured only first (or last) would carry that drift.
        for i in range(args.rounds):
            for system in systems[i % len(systems):] + systems[:i % len(systems)]:
                print(f"{system.name}: round {i + 1}/{args.rounds}", flush=True)
                system.rounds.append(run_round(system, agent, batch, args.concurrency))
                r = system.rounds[-1]
                print(f"{system.name}: {r['output_tok_s']:.1f} output tok/s, hit rate {r['hit_rate_programs']:.1%} "
                      f"(programs) / {r['hit_rate_replicas']:.1%} (replicas), requests per replica "
                      f"{[c['num_finished_requests'] for c in r['per_replica']]}", flush=True)
    finally:
        for system in systems:
            system.endpoint.close()
            system.stop()
    summaries: list[dict[str, Any]] = []
    for system in systems:
        summaries.append(summarize(system, summaries[0]["rounds"][-1]["answers"] if summaries else None))
    print_table(summaries, args.programs)
    out = output_file(args.out)
    out.write_text(json.dumps({"config": vars(args), "questions": questions(args.programs),
                               "results": summaries}, indent=1))
    print(f"wrote {out}")
    plot(summaries, out)


if __name__ == "__main__":
    main()
