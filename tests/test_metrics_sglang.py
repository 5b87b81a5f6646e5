"""/metrics as a dashboard made for SGLang reads it: SGLang's names and labels, parsed by
prometheus_client's own text parser; and label values bounded whatever priorities clients send."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.http.metrics import MAX_PRIORITY_LABELS
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient

pytestmark = pytest.mark.timeout(240)

SERVED_NAME = "tiny-served"


@pytest.fixture(scope="module")
def front(tiny_llama_dir: Path) -> Iterator[tuple[Runtime, HttpServerThread]]:
    runtime = Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, dtype="float32", enable_metrics=True)
    client = RuntimeClient(runtime.address)
    http = HttpServerThread(create_app(client, served_model_name=SERVED_NAME))
    try:
        yield runtime, http
    finally:
        http.stop()
        client.close()
        runtime.shutdown()


def _families(http: HttpServerThread) -> dict[str, object]:
    response = httpx2.get(http.url + "/metrics", timeout=30)
    assert response.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(response.text)}


def _generate(http: HttpServerThread, **extra: object) -> None:
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            **extra}
    response = httpx2.post(http.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_sglang_metric_names_types_and_labels(front: tuple[Runtime, HttpServerThread]) -> None:
    runtime, http = front
    _generate(http, stream=True)  # streamed: tokens arrive one by one, so inter-token gaps are measured
    # A DSL-style client over ZeroMQ: the sglang:* token counters cover it too (they are the runtime's).
    runtime.client.generate("A second client", sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                                "ignore_eos": True})
    families = _families(http)
    # The parser names a family without its _total / _bucket suffixes.
    expected = {
        "sglang:num_running_reqs": "gauge", "sglang:num_queue_reqs": "gauge", "sglang:token_usage": "gauge",
        "sglang:num_used_tokens": "gauge", "sglang:cache_hit_rate": "gauge", "sglang:gen_throughput": "gauge",
        "sglang:max_total_num_tokens": "gauge", "sglang:num_grammar_queue_reqs": "gauge",
        "sglang:prompt_tokens": "counter", "sglang:generation_tokens": "counter", "sglang:cached_tokens": "counter",
        "sglang:num_requests": "counter", "sglang:num_aborted_requests": "counter",
        "sglang:time_to_first_token_seconds": "histogram", "sglang:inter_token_latency_seconds": "histogram",
        "sglang:e2e_request_latency_seconds": "histogram", "sglang:queue_time_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)  # type: ignore[attr-defined]
        for sample in families[name].samples:  # type: ignore[attr-defined]
            assert sample.labels["model_name"] == SERVED_NAME, sample
            assert sample.labels["engine_type"] == "unified", sample
    gauge = families["sglang:num_running_reqs"].samples[0]  # type: ignore[attr-defined]
    assert gauge.labels["tp_rank"] == "0" and gauge.labels["pp_rank"] == "0"

    def value(name: str, suffix: str = "") -> float:
        (sample,) = [s for s in families[name].samples if s.name == name + suffix]  # type: ignore[attr-defined]
        return sample.value

    info = runtime.client.server_info()
    assert value("sglang:max_total_num_tokens") == info["slots_total"]
    assert value("sglang:generation_tokens", "_total") >= 4 + 3
    assert value("sglang:num_requests", "_total") >= 2
    # The front measures latencies of the requests it serves, under both names alike.
    assert value("sglang:time_to_first_token_seconds", "_count") >= 1
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        ours = sum(s.value for s in families["sgl_lite_" + name].samples if s.name.endswith("_count"))  # type: ignore[attr-defined]
        assert value("sglang:" + name, "_count") == ours, name
    # Ours stay beside SGLang's.
    assert "sgl_lite_num_running_reqs" in families and "sgl_lite_time_to_first_token_seconds" in families


def test_priority_label_values_are_bounded(front: tuple[Runtime, HttpServerThread]) -> None:
    _, http = front
    for priority in range(3 * MAX_PRIORITY_LABELS):
        _generate(http, priority=priority, sampling_params={"max_new_tokens": 1, "temperature": 0})
    families = _families(http)
    values = {s.labels["priority"] for s in families["sgl_lite_e2e_request_latency_seconds"].samples}  # type: ignore[attr-defined]
    assert len(values) <= MAX_PRIORITY_LABELS + 2, sorted(values)  # + "none" and "other"
    assert "other" in values
    counted = sum(s.value for s in families["sgl_lite_e2e_request_latency_seconds"].samples  # type: ignore[attr-defined]
                  if s.name.endswith("_count") and s.labels["priority"] not in ("none",))
    assert counted == 3 * MAX_PRIORITY_LABELS  # bucketed, not dropped
