"""Soak (bounded): hundreds of requests through a real `sgl-lite serve` subprocess under a KV pool small
enough to force eviction, retraction and preemption, with aborts, disconnects and killed client processes.

Checks: one final message per request, greedy outputs equal to an unloaded in-process Engine's, the
idle accounting invariant, and that the server's RSS did not grow from the first to the last third.
scripts/soak.py runs the same harness with thousands of requests.
"""

from __future__ import annotations

import threading
import time

import pytest

from sgl_lite.lang.launcher import Runtime, _child_env
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.testing.hostile_clients import CASES, HostileRun, hostile_server_args
from sgl_lite.testing.hostile_load import hostile_load_problems, soak_load
from sgl_lite.testing.kv_accounting import accounting_problems, idle_server_info
from sgl_lite.testing.soak import SoakConfig, _Progress, _report_stall, run_soak
from sgl_lite.testing.soak_checks import check_records, greedy_mismatches, reference_outputs

pytestmark = pytest.mark.timeout(600)

SOAK_SERVER_ARGS = dict(
    dtype="float32", device="cpu", context_length=512, max_total_tokens=640, max_running_requests=12,
    chunked_prefill_size=64, enable_priority_scheduling=True, schedule_policy="lpm", max_queued_requests=32,
    # Admission reserves room for only a tenth of the usual expected output: decode runs out of KV
    # and must retract, as a busy server does once its new-token ratio has decayed.
    schedule_conservativeness=0.1, log_level="warning",
)
# Python's allocator keeps freed arenas; a leak of even a few KiB per request would add up to more.
RSS_TOLERANCE_MIB = 16


BURST_PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog, then asks what the capital of France is"
                 for i in range(SOAK_SERVER_ARGS["max_running_requests"])]
BURST_PARAMS = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}


def retraction_burst(client: RuntimeClient) -> dict[str, list[int]]:
    """As many long requests at once as may run: admitted together (the reservation is a tenth of their
    output), they need more slots than the pool has before they finish, so decode must retract."""
    outputs: dict[str, list[int]] = {}
    threads = [threading.Thread(target=lambda p=p: outputs.__setitem__(p, client.generate(p, sampling_params=BURST_PARAMS).output_ids))
               for p in BURST_PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outputs


def test_soak_many_clients_small_pool(tiny_model):
    model = tiny_model
    config = SoakConfig(num_requests=360, seed=1)
    with Runtime(model_path=model, startup_timeout=180, client_timeout=120, **SOAK_SERVER_ARGS) as rt:
        result = run_soak(rt.address, config, server_pid=rt.pid, child_env=_child_env())
        burst = retraction_burst(rt.client)
        info = rt.client.server_info()
    summary = result.summary()
    print("soak:", summary, {k: info[k] for k in ("num_retractions", "num_preemptions", "cache_hit_rate")})
    assert not result.problems, result.problems[:10]
    assert check_records(result.records, config) == []
    assert summary["finished"] > config.num_requests // 2
    assert accounting_problems(info) == []
    # The pool really was too small: requests were retracted and preempted, and the cache was reused.
    assert info["num_retractions"] > 0 and info["num_preemptions"] > 0 and info["cache_hit_rate"] > 0
    growth_mib = (result.rss_kib[-1] - result.rss_kib[0]) / 1024
    assert growth_mib <= RSS_TOLERANCE_MIB, f"server RSS grew {growth_mib:.1f} MiB: {summary['rss_mib']}"
    with Engine(model_path=model, dtype="float32", device="cpu", context_length=512, max_total_tokens=16384) as engine:
        refs = reference_outputs(engine, result.records)
        burst_refs = {p: engine.generate(p, dict(BURST_PARAMS))["output_ids"] for p in BURST_PROMPTS}
    assert greedy_mismatches(result.records, refs) == []
    assert burst == burst_refs


def test_soak_beside_hostile_clients(tiny_model):
    """Issue 16's hostile cases run beside the normal clients (soak passes until every case has run): each
    gets its error, and the normal clients' greedy outputs, the accounting and the server's memory are as
    without them."""
    results = []
    with Runtime(model_path=tiny_model, startup_timeout=180, client_timeout=120,
                 **SOAK_SERVER_ARGS, **hostile_server_args()) as rt:
        with HostileRun(rt.address, seed=2, pause_s=0.05) as hostile:
            while not results or hostile.rounds_done < 1:
                config = SoakConfig(num_requests=240, killed_client_processes=0, seed=10 + len(results))
                results.append((config, run_soak(rt.address, config, server_pid=rt.pid, child_env=_child_env())))
        info = rt.client.server_info()
    print("hostile:", hostile.report.attempts, "soak passes:", [r.summary() for _, r in results])
    assert hostile.report.problems == []
    assert set(hostile.report.attempts) == set(CASES)
    for config, result in results:
        assert not result.problems, result.problems[:10]
        assert check_records(result.records, config) == []
    assert accounting_problems(info) == []
    growth_mib = (results[-1][1].rss_kib[-1] - results[0][1].rss_kib[0]) / 1024
    assert growth_mib <= RSS_TOLERANCE_MIB, f"server RSS grew {growth_mib:.1f} MiB"
    records = [rec for _, result in results for rec in result.records]
    with Engine(model_path=tiny_model, dtype="float32", device="cpu", context_length=512, max_total_tokens=16384) as engine:
        refs = reference_outputs(engine, records)
    assert greedy_mismatches(records, refs) == []


def test_soak_beside_a_prefill_hog_and_a_runaway_compile(tiny_model):
    """A prefill hog and a runaway grammar compile over the server's HTTP API beside the normal clients (issue
    53's hostile load, scripts/soak.py's default): every request still gets one final message and its greedy
    output, the hog's batches their answers, each compile its 400 after the timeout, /health its 200s."""
    results = []
    with Runtime(model_path=tiny_model, startup_timeout=180, client_timeout=120, **SOAK_SERVER_ARGS,
                 **hostile_server_args(runaway_compiles=True), grammar_compile_timeout=1.0) as rt:
        tolerated = ("the request queue is full", "higher priority")
        with soak_load(rt.url, rt.client.server_info(), max_prompts=4, seed=4, api_key=rt.api_key,
                       tolerated=tolerated) as load:
            # Soak passes until the compile has been refused and a hog batch answered (the queue's cap may
            # refuse a batch): at most 8.
            while len(results) < 8 and not (load.wait_answered(timeout_s=0) and "200" in load.stats["hog"].statuses):
                config = SoakConfig(num_requests=240, killed_client_processes=0, seed=20 + len(results))
                results.append((config, run_soak(rt.address, config, server_pid=rt.pid, child_env=_child_env())))
        report = load.report()
        info = idle_server_info(rt.client, timeout=60.0)  # the hog's last batch ends once its abort is seen
    print("hostile load:", report, "soak passes:", [r.summary() for _, r in results])
    assert hostile_load_problems(report) == []
    assert report["hog"]["statuses"].get("200", 0) >= 1 and report["runaway compile"]["answered"] >= 1
    assert "grammar" in report["runaway compile"]["messages"][0]
    for config, result in results:
        assert not result.problems, result.problems[:10]
        assert check_records(result.records, config) == []
    assert accounting_problems(info) == []
    records = [rec for _, result in results for rec in result.records]
    with Engine(model_path=tiny_model, dtype="float32", device="cpu", context_length=512, max_total_tokens=16384) as engine:
        refs = reference_outputs(engine, records)
    assert greedy_mismatches(records, refs) == []


def test_soak_with_the_disk_tier_and_failing_disk_io(tiny_model, tmp_path, monkeypatch):
    """The same soak with the disk tier on under the small pool and every 5th disk read or write failing:
    evicted prefixes come back from disk, failed I/O costs recomputation only, and the outputs, the accounting
    (the tier's holds included) and the server's memory are as without the tier."""
    monkeypatch.setenv("SGL_LITE_FAULT_INJECT", "disk_io:5")  # the server child inherits it
    config = SoakConfig(num_requests=240, killed_client_processes=0, seed=3)
    with Runtime(model_path=tiny_model, startup_timeout=180, client_timeout=120, **SOAK_SERVER_ARGS,
                 enable_hierarchical_cache=True, hicache_storage_dir=str(tmp_path)) as rt:
        result = run_soak(rt.address, config, server_pid=rt.pid, child_env=_child_env())
        info = rt.client.server_info()
    print("tier soak:", result.summary(), {k: v for k, v in info.items() if k.startswith("hicache_")})
    assert not result.problems, result.problems[:10]
    assert check_records(result.records, config) == []
    assert accounting_problems(info) == []
    assert info["hicache_loaded_tokens_total"] > 0 and info["hicache_io_errors_total"] > 0
    with Engine(model_path=tiny_model, dtype="float32", device="cpu", context_length=512, max_total_tokens=16384) as engine:
        refs = reference_outputs(engine, result.records)
    assert greedy_mismatches(result.records, refs) == []


def test_a_soak_whose_requests_stop_finishing_reports_what_the_server_holds(tiny_model):
    """A stalled server shows in a soak as a problem naming its queues and slots, printed as soon as the stall
    lasts stall_report_s (before, it showed only as clients waiting up to pytest's timeout); requests that keep
    finishing reset the clock."""
    with Runtime(model_path=tiny_model, startup_timeout=180, **SOAK_SERVER_ARGS) as rt:
        stop = threading.Event()
        moving, stalled = _Progress(50, None, 1), _Progress(50, None, 1)
        reports: dict[str, list[str]] = {"moving": [], "stalled": []}
        threads = [threading.Thread(target=_report_stall, args=(rt.address, None, progress, 1.5, stop, reports[name]))
                   for name, progress in (("moving", moving), ("stalled", stalled))]
        for t in threads:
            t.start()
        for _ in range(16):  # 4 s: one request done every 0.25 s
            time.sleep(0.25)
            moving.one_done()
        threads[1].join(10)
        stop.set()
        threads[0].join(5)
    assert reports["moving"] == []
    assert len(reports["stalled"]) == 1, reports
    assert "(0 of 50 done)" in reports["stalled"][0] and "'num_waiting': 0" in reports["stalled"][0], reports
