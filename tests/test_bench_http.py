"""The serving benchmark over HTTP (sgl_lite.bench.http_backend): SGLang's native /generate streamed
from a real sgl_lite HTTP front, and from sglang-router over replicas the benchmark starts itself.

Expected values come from the system itself: the same runtime's answers over ZeroMQ, its own
meta_info and counters, never constants.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Iterator

import pytest

from sgl_lite.bench.backends import RuntimeBackend
from sgl_lite.bench.config import BenchConfig, make_workload, parse_config
from sgl_lite.bench.driver import open_system, run_benchmark, run_workload
from sgl_lite.bench.http_backend import HTTPBackend, HTTPStreamError
from sgl_lite.bench.metrics import RequestRecord
from sgl_lite.bench.report import throughput_ratios
from sgl_lite.bench.workloads import Vocabulary
from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient

pytestmark = pytest.mark.timeout(120)

API_KEY = "bench-key"
SERVER_ARGS = {"dtype": "float32", "max_total_tokens": 4096, "log_level": "warning"}
# Small multi-turn agent workload: 3 sessions x 3 turns sharing a 48-token system prompt.
AGENT = dict(agent_num_sessions=3, agent_num_turns=3, agent_system_prompt_len=48, agent_task_len=8,
             agent_obs_len_min=2, agent_obs_len_max=6, agent_output_len=5)


class Live:
    def __init__(self, runtime: Runtime, http: HttpServerThread) -> None:
        self.runtime = runtime
        self.http = http


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path) -> Iterator[Live]:
    runtime = Runtime(model_path=str(tiny_llama_dir), startup_timeout=120, **SERVER_ARGS)
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), api_key=API_KEY))
    try:
        yield Live(runtime, http)
    finally:
        http.stop()
        runtime.shutdown()


def _config(model_dir: Path, tmp_path: Path, **overrides: object) -> BenchConfig:
    return BenchConfig(model_path=str(model_dir), output_dir=str(tmp_path), progress=False, plots=False,
                       server_args=dict(SERVER_ARGS), **{**AGENT, **overrides})


def _run(backend, workload) -> list[RequestRecord]:
    async def go() -> list[RequestRecord]:
        try:
            backend.reset()
            records, _ = await run_workload(backend, workload)
            return records
        finally:
            await backend.close_async_resources()

    return asyncio.run(go())


async def _collect(backend: HTTPBackend, prompt: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
    ids: list[int] = []
    finals = []
    try:
        async for event in backend.stream(prompt, max_new_tokens):
            ids += event.new_ids
            if event.meta_info is not None:
                finals.append(event.meta_info)
    finally:
        await backend.close_async_resources()
    assert len(finals) == 1
    return ids, finals[0]


async def _warm_up(backend: HTTPBackend) -> None:
    try:
        await backend.warm_up()
    finally:
        await backend.close_async_resources()


def test_stream_matches_the_runtime_and_reset_empties_the_cache(live: Live) -> None:
    backend = HTTPBackend("http", live.http.url, api_key=API_KEY)
    prompt = list(range(10, 70))
    backend.reset()
    ids, meta = asyncio.run(_collect(backend, prompt, 7))
    with RuntimeClient(live.runtime.address) as client:
        direct = client.generate(input_ids=prompt, sampling_params={"max_new_tokens": 7, "temperature": 0.0,
                                                                    "ignore_eos": True})
    assert ids == list(direct.output_ids)
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 7
    assert meta["cached_tokens"] == 0 and meta["finish_reason"]["type"] == "length"
    # The direct request cached the prompt; a repeat hits it, and reset() forgets it again.
    assert asyncio.run(_collect(backend, prompt, 3))[1]["cached_tokens"] == len(prompt) - 1
    backend.reset()
    assert asyncio.run(_collect(backend, prompt, 3))[1]["cached_tokens"] == 0


def test_errors_are_raised_with_the_servers_reason(live: Live) -> None:
    backend = HTTPBackend("http", live.http.url, api_key=API_KEY)
    with RuntimeClient(live.runtime.address) as client:
        vocab_size = client.server_info()["vocab_size"]
    with pytest.raises(HTTPStreamError, match="400.*input_ids"):
        asyncio.run(_collect(backend, [1, 2, vocab_size + 5], 3))
    with pytest.raises(HTTPStreamError, match="401"):
        asyncio.run(_collect(HTTPBackend("http", live.http.url, api_key="wrong"), [1, 2, 3], 3))


def test_multiturn_over_http_equals_zeromq_and_later_turns_hit_the_cache(live: Live, tiny_llama_dir: Path,
                                                                        tmp_path: Path) -> None:
    config = _config(tiny_llama_dir, tmp_path)
    workload = make_workload(config, Vocabulary(200, frozenset({0, 1, 2})))
    over_http = _run(HTTPBackend("http", live.http.url, api_key=API_KEY), workload)
    with RuntimeClient(live.runtime.address) as client:
        over_zmq = _run(RuntimeBackend("zmq", client), workload)
    assert len(over_http) == workload.num_requests and all(r.ok for r in over_http), [r.error for r in over_http]
    key = lambda r: (r.session_id, r.turn)  # noqa: E731
    zmq_by_turn = {key(r): r for r in over_zmq}
    for r in over_http:
        assert r.output_ids == zmq_by_turn[key(r)].output_ids  # greedy: same tokens over either transport
        assert r.prompt_tokens == len(r.prompt_ids) and r.completion_tokens == len(r.output_ids) == 5
        assert len(r.chunk_times) >= 2  # streamed, not one reply at the end
    assert_later_turns_reuse_history(over_http)


def test_bench_command_line_drives_a_running_http_server(live: Live, tiny_llama_dir: Path, tmp_path: Path) -> None:
    config = parse_config(["--url", live.http.url, "--api-key", API_KEY, "--systems", "sgl_lite",
                           "--model-path", "not-used-the-server-says", "--output-dir", str(tmp_path), "--no-plots",
                           "--no-progress", *[f"--{k.replace('_', '-')}={v}" for k, v in AGENT.items()]])
    report = run_benchmark(config)
    assert report["model_path"] == str(tiny_llama_dir)  # asked from the server's /get_model_info
    (summary,) = report["systems"]
    assert summary["completed"] == 9 and summary["failed"] == 0
    assert summary["output_throughput"] > 0 and summary["ttft_ms"]["p50"] is not None
    later = [t for t in summary["per_turn"] if t["turn"] > 0]
    assert all(t["hit_rate"] > 0.5 for t in later), summary["per_turn"]
    assert summary["cache_hit_rate"] <= summary["ideal_cache_hit_rate"] + 1e-9


def test_config_names_bad_systems_and_flags() -> None:
    assert parse_config(["--systems", "router-dp1,router-dp2"]).systems == ("router-dp1", "router-dp2")
    for bad in (["--systems", "router-dp0"], ["--systems", "router-dpx"], ["--systems", "router-dp2,router-dp2"]):
        with pytest.raises(ValueError, match="--systems"):
            parse_config(bad)
    with pytest.raises(ValueError, match="--address.*--url"):
        parse_config(["--address", "tcp://127.0.0.1:1", "--url", "http://127.0.0.1:2"])
    with pytest.raises(ValueError, match="--url"):
        parse_config(["--url", "127.0.0.1:8000"])
    with pytest.raises(ValueError, match="--router-args"):
        parse_config(["--router-args=--cache-threshold '0.5"])


def test_ratios_without_sgl_lite_are_against_the_first_system() -> None:
    summaries = [{"system": name, "request_throughput": rps, "output_throughput": 10 * rps, "input_throughput": 0.0}
                 for name, rps in (("router-dp1", 2.0), ("router-dp2", 3.0))]
    (row,) = throughput_ratios(summaries)
    assert row["system"] == "router-dp2" and row["baseline"] == "router-dp1"
    assert row["request_throughput"] == pytest.approx(1.5) and row["input_throughput"] is None
    with_ref = throughput_ratios([{**summaries[0], "system": "no-cache"}, {**summaries[1], "system": "sgl_lite"}])
    assert [(r["system"], r["baseline"]) for r in with_ref] == [("sgl_lite", "no-cache")]


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router not installed")
def test_router_system_keeps_sessions_on_their_cached_replica(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # Routing by cache match alone (sglang-router's default threshold: load decides only past 64 requests
    # of difference): at sgl_lite's threshold of 1, a replica that happens to hold 2 more requests in flight
    # takes a later turn by load, which is that threshold's purpose, not what this test checks.
    config = _config(tiny_llama_dir, tmp_path, router_args="--balance-abs-threshold 64")
    workload = make_workload(config, Vocabulary(200, frozenset({0, 1, 2})))
    backend = open_system("router-dp2", config)
    try:
        assert isinstance(backend, HTTPBackend) and len(backend.worker_urls) == 2
        asyncio.run(_warm_up(backend))
        before = backend.replica_prompt_tokens()
        records = _run(backend, workload)
        served = [after - b for b, after in zip(before, backend.replica_prompt_tokens())]
        backend.reset()
        repeat = asyncio.run(_collect(backend, records[-1].prompt_ids, 2))[1]
    finally:
        backend.close()
    assert len(records) == workload.num_requests and all(r.ok for r in records), [r.error for r in records]
    # Every prompt token sent through the router was served by one of the replicas.
    assert sum(served) == sum(r.prompt_tokens for r in records)
    # cache_aware routing sent each later turn to the replica holding the session's history, and
    # the replica's meta_info came back through the router.
    assert_later_turns_reuse_history(records)
    assert repeat["cached_tokens"] == 0  # reset() flushed whichever replica held that prompt


def assert_later_turns_reuse_history(records: list[RequestRecord]) -> None:
    """Each later turn of a session reports at least the previous turn's prompt as cached."""
    by_session: dict[int, list[RequestRecord]] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for earlier, later in zip(turns, turns[1:]):
            assert later.cached_tokens >= earlier.prompt_tokens, (earlier.prompt_tokens, later.cached_tokens)
