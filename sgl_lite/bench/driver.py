"""The load driver: serve one workload on each selected system in turn and report.

Systems run one after another, never side by side (on a machine of few cores they would take each
other's cores): `sgl_lite` (the runtime at --address over ZeroMQ, the HTTP server or router at --url,
or a runtime started with the given
server args), `no-cache` (a second runtime with --disable-radix-cache), `hf` (the naive transformers
server, in process) and `router-dpN` (N replicas behind sglang-router, started here with
sgl_lite.cluster, driven over HTTP). Each starts cold: warm-up requests, then its prefix cache is
flushed.

Arrivals: sessions start all at once (--request-rate inf) or as a Poisson process; turn t+1 of a
session is sent only when turn t has finished; at most --max-concurrency requests are in flight.

Entry points: `main(argv)` (the command line, used by scripts/bench_serving.py) and
`run_benchmark(config)` (returns the report dict).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import shlex
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from sgl_lite.bench.backends import GenerationBackend, RuntimeBackend
from sgl_lite.bench.chat_rendered import ChatRenderedBackend, ChatRenderer
from sgl_lite.bench.config import BenchConfig, make_workload, parse_config, router_dp_size
from sgl_lite.bench.metrics import RequestRecord, summarize
from sgl_lite.bench.report import markdown_table, per_turn_table, ratio_lines, throughput_ratios, write_json, write_plots
from sgl_lite.bench.workloads import Session, Vocabulary, Workload

logger = logging.getLogger(__name__)


def arrival_offsets(num_sessions: int, request_rate: float, seed: int) -> list[float]:
    """Start time of each session in seconds from the run's start (Poisson process, or all at 0)."""
    if math.isinf(request_rate):
        return [0.0] * num_sessions
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_sessions)
    return np.concatenate([[0.0], np.cumsum(gaps)[:-1]]).tolist() if num_sessions else []


async def _run_request(backend: GenerationBackend, session: Session, turn: int, pieces: list[list[int]]) -> RequestRecord:
    """One turn; its prompt is `pieces` joined (the session's first prompt, then each answer and appendix)."""
    prompt = [t for piece in pieces for t in piece]
    record = RequestRecord(session.session_id, turn, session.group, prompt, time.perf_counter())
    try:
        async for event in backend.stream_turn(pieces, session.output_len):
            if event.new_ids:
                record.output_ids += event.new_ids
                record.chunk_times.append(event.time)
                record.chunk_sizes.append(len(event.new_ids))
            if event.meta_info is not None:
                meta = event.meta_info
                record.finish_time = event.time
                record.prompt_tokens = int(meta.get("prompt_tokens", len(prompt)))
                record.completion_tokens = int(meta.get("completion_tokens", len(record.output_ids)))
                record.cached_tokens = int(meta.get("cached_tokens", 0))
    except Exception as e:  # a failed request is reported, not fatal: the run goes on
        record.error = f"{type(e).__name__}: {e}"
    if record.error is None and record.finish_time is None:
        record.error = "stream ended without a final event"
    return record


async def run_workload(backend: GenerationBackend, workload: Workload, *, request_rate: float = math.inf,
                       max_concurrency: int | None = None, seed: int = 1,
                       progress: bool = False) -> tuple[list[RequestRecord], float]:
    """Serve `workload` on `backend`; returns the records (send order) and the run's wall time."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()
    records: list[RequestRecord] = []
    bar = tqdm(total=workload.num_requests, desc=backend.name, disable=not progress, leave=False)
    start = time.perf_counter()

    async def run_session(session: Session, offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        pieces = [session.first_prompt]
        for turn in range(session.num_turns):
            async with limit:
                record = await _run_request(backend, session, turn, pieces)
            records.append(record)
            bar.update(1)
            if not record.ok:
                bar.update(session.num_turns - turn - 1)  # the session's later turns are never sent
                return
            if turn + 1 < session.num_turns:
                pieces = session.next_pieces(turn, pieces, record.output_ids)

    offsets = arrival_offsets(len(workload.sessions), request_rate, seed)
    await asyncio.gather(*(run_session(s, o) for s, o in zip(workload.sessions, offsets)))
    duration = time.perf_counter() - start
    bar.close()
    return sorted(records, key=lambda r: r.send_time), duration


def open_system(name: str, config: BenchConfig) -> GenerationBackend:
    """Start (or connect to) one system; the caller closes it. With --prompt-format chat a token-id system
    gets each turn as a chat server would prefill it (bench/chat_rendered.py)."""
    render = None
    if config.prompt_format == "chat" and not _openai_url(name, config):
        from sgl_lite.runtime.model_executor import loader

        folder = loader.resolve_model_path(config.model_path)
        render = ChatRenderer(str(folder), loader.load_tokenizer(folder))  # before any system starts
    backend = _open_backend(name, config)
    return backend if render is None else ChatRenderedBackend(backend, render)


def _open_backend(name: str, config: BenchConfig) -> GenerationBackend:
    if name == "sgl_lite" and config.address:
        return RuntimeBackend(name, _patient_client(config.address, config.api_key))
    openai_url = _openai_url(name, config)
    if openai_url:
        from sgl_lite.bench.openai_chat_backend import OpenAIChatBackend
        from sgl_lite.runtime.model_executor import loader

        tokenizer = loader.load_tokenizer(loader.resolve_model_path(config.model_path))
        return OpenAIChatBackend(name, openai_url, tokenizer, api_key=config.api_key, chat_history=config.chat_history)
    if name == "sgl_lite" and config.url:
        from sgl_lite.bench.http_backend import HTTPBackend

        return HTTPBackend(name, config.url, api_key=config.api_key)
    dp_size = router_dp_size(name)
    if dp_size is not None:
        return _open_router_cluster(name, dp_size, config)
    if name in ("sgl_lite", "no-cache"):
        from sgl_lite.lang.launcher import Runtime

        runtime = Runtime(config.model_path, startup_timeout=config.startup_timeout,
                          disable_radix_cache=(name == "no-cache"), **config.server_args)
        return RuntimeBackend(name, _patient_client(runtime.address, runtime.api_key), runtime)
    if name == "hf":
        from sgl_lite.bench.naive_hf_server import HFBackend, NaiveHFServer
        from sgl_lite.runtime.model_executor.loader import resolve_model_path

        return HFBackend(NaiveHFServer(resolve_model_path(config.model_path), batch_size=config.naive_batch_size,
                                       dtype=config.server_args.get("dtype", "auto"), device=config.server_args.get("device", "auto")))
    raise ValueError(f"unknown system {name!r}")


def _openai_url(name: str, config: BenchConfig) -> str | None:
    """Where the system `name` is driven over /v1/chat/completions; None for a token-id system."""
    if name == "sgl_lite" and config.address:
        return None
    return config.openai_systems.get(name) or (config.url if name == "sgl_lite" and config.backend == "openai-chat" else None)


def _open_router_cluster(name: str, dp_size: int, config: BenchConfig) -> GenerationBackend:
    """`dp_size` replicas (each pinned to its share of the CPUs) behind sglang-router, as `sgl-lite
    serve --dp-size N --port P` runs them; the backend drives the router and owns the cluster."""
    from sgl_lite.bench.http_backend import HTTPBackend
    from sgl_lite.cluster import Cluster, free_port
    from sgl_lite.runtime.server_args import ServerArgs

    args = ServerArgs.from_kwargs(model_path=config.model_path, **config.server_args).replace(port=free_port())
    cluster = Cluster(args, dp_size, config.router_policy, startup_timeout=config.startup_timeout,
                      router_args=shlex.split(config.router_args))
    cluster.start()
    return HTTPBackend(name, cluster.url, api_key=args.api_key, worker_urls=cluster.worker_urls, owned=cluster)


def _patient_client(address: str, api_key: str | None) -> Any:
    """A client whose requests may wait an hour (a benchmark queues many); liveness comes from the
    connection's heartbeats, so a long step never looks like a dead runtime. `address` may be the
    server's HTTP URL (its ZeroMQ endpoint is found from it)."""
    from sgl_lite.runtime.client import RuntimeClient
    from sgl_lite.runtime.client.discovery import discover_zmq_address

    if address.startswith(("http://", "https://")):
        address = discover_zmq_address(address, api_key)
    return RuntimeClient(address, api_key=api_key, timeout=3600.0)


def resolve_model(config: BenchConfig) -> tuple[str, Vocabulary]:
    """The model every system serves (that of the --address runtime or the SGLang-native --url server,
    when given; --model-path for OpenAI-compatible servers) and its prompt vocabulary."""
    from sgl_lite.runtime.model_executor import loader

    model_path = config.model_path
    if config.url and config.backend == "sglang":
        import httpx2

        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        response = httpx2.get(config.url.rstrip("/") + "/get_model_info", headers=headers, timeout=60.0)
        response.raise_for_status()
        model_path = str(response.json().get("model_path") or model_path)
    if config.address:
        with _patient_client(config.address, config.api_key) as client:
            model_path = str(client.server_info().get("model_path") or model_path)
    folder = loader.resolve_model_path(model_path)
    vocab = Vocabulary.from_tokenizer(loader.load_tokenizer(folder), loader.load_config(folder).vocab_size)
    return model_path, vocab


def measure_system(name: str, config: BenchConfig, workload: Workload,
                   backend: GenerationBackend | None = None) -> dict[str, Any]:
    """Serve `workload` on the system `name` (opened here, unless `backend` is given) and summarize;
    the backend is closed afterwards."""
    logger.info("starting system %s", name)
    backend = backend or open_system(name, config)

    replica_tokens: list[int] | None = None

    async def warm_up_then_run() -> tuple[list[RequestRecord], float, float, float]:
        nonlocal replica_tokens
        # One event loop for the whole measurement: HTTP connection pools are bound to it.
        try:
            await backend.warm_up()
            backend.reset()  # blocking calls are fine here: nothing is in flight
            tokens_before = backend.replica_prompt_tokens()
            load_before = os.getloadavg()[0]
            records, duration = await run_workload(
                backend, workload, request_rate=config.request_rate, max_concurrency=config.max_concurrency,
                seed=config.seed, progress=config.progress)
            load_after = os.getloadavg()[0]
            tokens_after = backend.replica_prompt_tokens()
            if tokens_before is not None and tokens_after is not None:
                replica_tokens = [after - before for before, after in zip(tokens_before, tokens_after)]
            return records, duration, load_before, load_after
        finally:
            await backend.close_async_resources()

    try:
        records, duration, load_before, load_after = asyncio.run(warm_up_then_run())
    finally:
        backend.close()
    summary = summarize(name, records, duration, note=backend.latency_note)
    # Other work on the machine skews a comparison of systems measured one after another: keep the record.
    summary["load_avg_1m"] = [load_before, load_after]
    summary["failed"] = workload.num_requests - summary["completed"]  # including turns never sent
    if replica_tokens is not None:
        summary["replica_prompt_tokens"] = replica_tokens  # how the router spread the work
    if summary["errors"]:
        logger.warning("%s: %d of %d requests failed: %s", name, summary["failed"], workload.num_requests,
                       "; ".join(summary["errors"]))
    summary["requests"] = [r.to_json() for r in records]
    return summary


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Measure every system of `config` on its workload; print and write the report; return it."""
    config.validate()
    model_path, vocab = resolve_model(config)
    config = dataclasses.replace(config, model_path=model_path)
    workload = make_workload(config, vocab)
    summaries = [measure_system(name, config, workload) for name in config.all_systems]
    ratios = throughput_ratios(summaries)
    stem = f"{workload.name}_{time.strftime('%Y%m%d-%H%M%S')}"
    report: dict[str, Any] = {
        "workload": workload.name, "workload_params": workload.params, "num_requests": workload.num_requests,
        "model_path": model_path, "request_rate": config.request_rate, "max_concurrency": config.max_concurrency,
        "naive_batch_size": config.naive_batch_size, "server_args": config.server_args,
        "systems": summaries, "ratios": ratios,
    }
    out_dir = Path(config.output_dir)
    report["json_path"] = str(out_dir / f"{stem}.json")
    if config.plots:
        report["plots"] = [str(p) for p in write_plots(summaries, out_dir, stem, per_turn=workload.max_turns > 1)]
    write_json(out_dir / f"{stem}.json", report)
    print(format_report(report))
    return report


def format_report(report: dict[str, Any]) -> str:
    summaries = report["systems"]
    parts = [f"## {report['workload']}: {report['num_requests']} requests, {report['workload_params']}",
             markdown_table(summaries)]
    if report["ratios"]:
        parts.append(ratio_lines(report["ratios"]))
    if any(len(s["per_turn"]) > 1 for s in summaries):
        parts.append(per_turn_table(summaries))
    parts.append(f"report: {report['json_path']}" + (f"; plots: {', '.join(report['plots'])}" if report.get("plots") else ""))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None, prog: str = "bench_serving") -> int:
    """The command line (`prog` names it in usage messages); returns the exit status."""
    try:
        config = parse_config(argv, prog)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request otherwise
    run_benchmark(config)
    return 0
