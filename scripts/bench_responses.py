"""An agent's turns through the Responses API's `previous_response_id` against resending the whole history over
chat completions: request bytes, server CPU and speed per turn, both on one `sgl-lite serve`, in one run.

    python scripts/bench_responses.py                              # 4 sessions x 6 turns x 2 rounds
    python scripts/bench_responses.py --sessions 2 --turns 3 --rounds 1

The workload: --sessions concurrent agent sessions share a system prompt (`instructions`: a fixed line and
--system-chars of seeded words); each makes --turns requests one after another, greedy, at most --max-tokens
out. Every turn appends a tool result (--obs-chars of seeded words, numbers and identifiers; the first turn
also carries the session's task). The default server has no tool-call parser, so a tool result travels as
a user message; the bytes are the same either way. The two modes send the same conversation:

- responses: POST /v1/responses with `instructions`, only the new input items and the previous turn's
  `previous_response_id` (store on, the default): the server keeps the conversation;
- chat: POST /v1/chat/completions with the system message and the whole history (every earlier tool
  result and the model's answers as assistant messages).

Each round runs both modes on the same sessions (the order alternates round by round, --rounds), each mode
after a /flush_cache, so neither reads the other's prefixes from the radix cache. Per mode: the request
body's bytes per turn (mean, and at the last turn), the server's CPU seconds per turn (user + system time of
the serve process and its descendants over the mode's runs, bench_peers.group_cpu_seconds, divided by the
turns), output tokens per second of wall time, the turn's end-to-end p50 (not streamed) and the share of
prompt tokens read from the prefix cache (`usage`). Prints a markdown table, the ratios responses / chat and
how many turns got the same prompt and output in both modes (greedy, but a batch's makeup, which timing
decides, can tip a close token), writes JSON and a PNG (bytes and latency by turn). Uses the `openai` client.

Usage: python scripts/bench_responses.py [--model-path smollm2-135m] [--sessions 4] [--turns 6] [--rounds 2]
       [--obs-chars 1500] [--system-chars 1000] [--max-tokens 32] [--seed 0] [--out artifacts/bench_responses.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import openai  # noqa: E402
from bench_peers import group_cpu_seconds  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, pyplot, save_png  # noqa: E402
from sgl_lite.lang.launcher import Runtime  # noqa: E402

MODES = ("responses", "chat")
WORDS = ("error", "file", "line", "test", "passed", "failed", "return", "import", "module", "value", "None",
         "config", "path", "build", "warning", "assert", "expected", "got", "call", "stack", "frame", "index",
         "list", "dict", "string", "self", "def", "class", "token", "cache", "request", "status", "output")
FLUSH_TIMEOUT_S = 60.0


def seeded_text(seed: str, chars: int) -> str:
    """Exactly `chars` characters of tool-output-like text (words, numbers, identifiers), the same for a seed."""
    rng = random.Random(seed)
    parts: list[str] = []
    length = -1  # the joined length: a space between parts, none before the first
    while length < chars:
        kind = rng.random()
        part = (rng.choice(WORDS) if kind < 0.7 else str(rng.randrange(10**6)) if kind < 0.85
                else f"{rng.choice(WORDS)}_{rng.randrange(100)}.py:{rng.randrange(1, 500)}")
        parts.append(part)
        length += len(part) + 1
    return " ".join(parts)[:chars]


@dataclass
class Workload:
    """What every session says: the shared instructions, each session's task and its tool result per turn."""

    instructions: str
    tasks: list[str]
    observations: list[list[str]]  # [session][turn]

    def new_input(self, session: int, turn: int) -> list[str]:
        """The user messages turn `turn` of `session` adds: the task first, then each turn's tool result."""
        return ([self.tasks[session]] if turn == 0 else []) + [self.observations[session][turn]]


def make_workload(sessions: int, turns: int, obs_chars: int, system_chars: int, seed: int) -> Workload:
    instructions = ("You are a coding agent. Read each tool result and say what to do next, briefly.\n"
                    + seeded_text(f"{seed}:system", system_chars))
    tasks = [f"Task {s}: find why test_{s} fails in module_{s}.py. Tool results follow." for s in range(sessions)]
    observations = [[seeded_text(f"{seed}:{s}:{t}", obs_chars) for t in range(turns)] for s in range(sessions)]
    return Workload(instructions, tasks, observations)


class SessionClient:
    """One session's `openai` client; records the size of every request body it sends."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.sent: list[int] = []
        http = openai.DefaultHttpxClient(event_hooks={"request": [lambda request: self.sent.append(len(request.content))]})
        self.openai = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key or "unused", http_client=http,
                                    max_retries=0, timeout=3600)

    def close(self) -> None:
        self.openai.close()


def run_session(client: SessionClient, mode: str, work: Workload, session: int, model: str, max_tokens: int,
                on_turn: Any) -> list[dict[str, Any]]:
    """The session's turns in `mode`, one after another; one record per turn."""
    records: list[dict[str, Any]] = []
    history: list[dict[str, str]] = []  # chat: everything after the system message
    previous: str | None = None  # responses: the last turn's id
    for turn in range(len(work.observations[session])):
        new = [{"role": "user", "content": text} for text in work.new_input(session, turn)]
        start = time.perf_counter()
        if mode == "responses":
            extra = {"previous_response_id": previous} if previous else {}
            reply = client.openai.responses.create(model=model, instructions=work.instructions, max_output_tokens=max_tokens,
                                                   temperature=0, input=[{"type": "message", **m} for m in new], **extra)
            previous, text = reply.id, reply.output_text
            used = reply.usage
            prompt, cached, output = used.input_tokens, used.input_tokens_details.cached_tokens, used.output_tokens
        else:
            history += new
            reply = client.openai.chat.completions.create(
                model=model, max_tokens=max_tokens, temperature=0,
                messages=[{"role": "system", "content": work.instructions}, *history])
            text = reply.choices[0].message.content or ""
            history.append({"role": "assistant", "content": text})
            used = reply.usage
            details = used.prompt_tokens_details
            prompt, cached, output = used.prompt_tokens, details.cached_tokens if details else 0, used.completion_tokens
        records.append({"session": session, "turn": turn, "e2e_s": time.perf_counter() - start,
                        "sent_bytes": client.sent[-1], "prompt_tokens": prompt, "cached_tokens": cached or 0,
                        "output_tokens": output, "text": text})
        on_turn()
    return records


def summarize(mode: str, records: list[dict[str, Any]], wall_s: float, server_cpu_s: float) -> dict[str, Any]:
    """A mode's figures from its turn records and the wall and server CPU seconds its runs took."""
    last = max(r["turn"] for r in records)
    return {"mode": mode, "turns": len(records), "wall_s": wall_s, "server_cpu_s": server_cpu_s,
            "sent_bytes_per_turn": statistics.fmean(r["sent_bytes"] for r in records),
            "sent_bytes_last_turn": statistics.fmean(r["sent_bytes"] for r in records if r["turn"] == last),
            "server_cpu_s_per_turn": server_cpu_s / len(records),
            "output_tok_s": sum(r["output_tokens"] for r in records) / wall_s,
            "e2e_p50_s": statistics.median(r["e2e_s"] for r in records),
            "cached_share": sum(r["cached_tokens"] for r in records) / max(1, sum(r["prompt_tokens"] for r in records))}


def same_turns(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    """How many (session, turn) pairs got the same prompt length and the same output in both runs."""
    key = lambda r: (r["session"], r["turn"])  # noqa: E731
    other = {key(r): (r["prompt_tokens"], r["text"]) for r in b}
    return sum(other.get(key(r)) == (r["prompt_tokens"], r["text"]) for r in a)


def flush(rt: Runtime) -> None:
    """Empty the radix cache, waiting for the runtime to go idle (a flush is refused while requests run)."""
    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    while not rt.client.flush_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"/flush_cache still refused after {FLUSH_TIMEOUT_S:g} s: the runtime never went idle")
        time.sleep(0.2)


def run_mode(rt: Runtime, mode: str, work: Workload, model: str, args: argparse.Namespace,
             bar: tqdm) -> tuple[list[dict[str, Any]], float, float]:
    """Every session's turns in `mode`, concurrently, from an empty cache: (records, wall s, server CPU s)."""
    flush(rt)
    clients = [SessionClient(rt.url, rt.api_key) for _ in range(args.sessions)]
    cpu_before, start = group_cpu_seconds(rt.pid), time.perf_counter()
    try:
        with ThreadPoolExecutor(args.sessions) as pool:
            futures = [pool.submit(run_session, clients[s], mode, work, s, model, args.max_tokens, lambda: bar.update(1))
                       for s in range(args.sessions)]
            records = [r for future in futures for r in future.result()]
    finally:
        wall, cpu = time.perf_counter() - start, group_cpu_seconds(rt.pid) - cpu_before
        for client in clients:
            client.close()
    return records, wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--sessions", type=int, default=4, help="concurrent agent sessions")
    p.add_argument("--turns", type=int, default=6, help="requests per session")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, the order alternating")
    p.add_argument("--obs-chars", type=int, default=1500, help="characters of each turn's tool result")
    p.add_argument("--system-chars", type=int, default=1000, help="characters of seeded text in the instructions")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per turn at most (greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=artifact_path("bench_responses.json"))
    args = p.parse_args()
    for name in ("sessions", "turns", "rounds", "obs_chars", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.system_chars < 0:
        p.error(f"--system-chars must be at least 0; got {args.system_chars}")
    work = make_workload(args.sessions, args.turns, args.obs_chars, args.system_chars, args.seed)
    records: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    spent = {m: [0.0, 0.0] for m in MODES}  # mode -> [wall s, server CPU s] over its rounds
    rounds: list[dict[str, Any]] = []
    with Runtime(args.model_path, startup_timeout=1800, log_level="warning") as rt:
        warm = SessionClient(rt.url, rt.api_key)  # the first requests pay one-off costs: not measured
        model = warm.openai.models.list().data[0].id
        for mode in MODES:
            run_session(warm, mode, make_workload(1, 2, 64, 64, args.seed + 1), 0, model, 4, lambda: None)
        warm.close()
        bar = tqdm(total=args.rounds * len(MODES) * args.sessions * args.turns, unit="turn")
        for r in range(args.rounds):
            this_round: dict[str, list[dict[str, Any]]] = {}
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                bar.set_description(f"round {r + 1}/{args.rounds} {mode}")
                turns, wall, cpu = run_mode(rt, mode, work, model, args, bar)
                for t in turns:
                    t["round"] = r
                this_round[mode] = turns
                records[mode] += turns
                spent[mode][0] += wall
                spent[mode][1] += cpu
            rounds.append({"round": r, "same_turns": same_turns(*this_round.values())})
        bar.close()
    results = [summarize(m, records[m], *spent[m]) for m in MODES]
    report(args, results, rounds, records)


def report(args: argparse.Namespace, results: list[dict[str, Any]], rounds: list[dict[str, Any]],
           records: dict[str, list[dict[str, Any]]]) -> None:
    print(f"\n{args.sessions} sessions x {args.turns} turns x {args.rounds} rounds, {args.obs_chars}-character tool "
          f"results, {args.max_tokens} tokens out, model {args.model_path}")
    print("| mode | bytes sent / turn | at the last turn | server CPU s / turn | output tok/s | e2e p50 | prompt cached |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['mode']} | {r['sent_bytes_per_turn']:,.0f} | {r['sent_bytes_last_turn']:,.0f} | "
              f"{r['server_cpu_s_per_turn']:.3f} | {r['output_tok_s']:.1f} | {r['e2e_p50_s']:.2f} s | "
              f"{100 * r['cached_share']:.0f}% |")
    resp, chat = results
    ratios = {k: resp[k] / chat[k] if chat[k] else None for k in
              ("sent_bytes_per_turn", "sent_bytes_last_turn", "server_cpu_s_per_turn", "output_tok_s", "e2e_p50_s")}
    print("responses / chat: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if v is not None))
    turns = args.sessions * args.turns
    print("turns with the same prompt and output in both modes: "
          + ", ".join(f"round {r['round'] + 1}: {r['same_turns']}/{turns}" for r in rounds))
    out = output_file(args.out)
    out.write_text(json.dumps({"config": vars(args), "results": results, "ratios": ratios, "rounds": rounds,
                               "turns": records}, indent=1))
    print(f"wrote {out}")
    plot(records, out)


def plot(records: dict[str, list[dict[str, Any]]], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (sent, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, turns in records.items():
        steps = sorted({r["turn"] for r in turns})
        by_turn = lambda key: [statistics.fmean(r[key] for r in turns if r["turn"] == t) for t in steps]  # noqa: E731
        sent.plot([t + 1 for t in steps], by_turn("sent_bytes"), marker="o", label=mode)
        latency.plot([t + 1 for t in steps], by_turn("e2e_s"), marker="o", label=mode)
    sent.set(xlabel="turn", ylabel="request body (bytes, mean over sessions)")
    latency.set(xlabel="turn", ylabel="end-to-end (s, mean over sessions)")
    sent.legend()
    save_png(fig, out)


if __name__ == "__main__":
    main()
