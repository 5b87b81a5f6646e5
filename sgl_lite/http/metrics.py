"""Prometheus metrics of one HTTP app (its own CollectorRegistry, so several apps can live in a process).

Two sources:
- what the HTTP front observes per request: outcomes, token counts, TTFT, inter-token latency,
  end-to-end latency and queue wait (from meta_info["queue_time"] when the runtime reports it),
  the latency histograms labelled by priority class (at most MAX_PRIORITY_LABELS distinct values,
  the rest under "other": each label value is a time series kept forever, so a client choosing
  priorities freely must not be able to grow /metrics without bound);
- the runtime's scheduler stats, fetched from server_info at scrape time and exported as gauges
  (queue length, running requests, KV slots used/evictable, cache hit rate; with speculative decoding,
  accepted draft tokens per verification and acceptance rate) and counters (preemptions, retractions;
  verifications, draft and accepted tokens).
The same measurements are exported under SGLang's names by sglang_metrics.py.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sgl_lite.http.sglang_metrics import SglangMetrics, spec_accept_length

PREFIX = "sgl_lite_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_INTER_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Scheduler stats key (Scheduler.stats()) -> (metric name, help). Gauges are point-in-time, counters only grow.
_RUNTIME_GAUGES = {
    "num_waiting": ("num_queue_reqs", "Requests waiting in the runtime's queue."),
    "num_running": ("num_running_reqs", "Requests in the runtime's running batch."),
    "slots_evictable": ("kv_slots_evictable", "KV slots held only by the prefix cache (evictable)."),
    "slots_protected": ("kv_slots_protected", "KV slots of cached prefixes locked by running requests."),
    "slots_loading": ("kv_slots_loading", "KV slots the hierarchical cache's loads are reading into from disk."),
    "slots_total": ("kv_slots_total", "KV slots in the pool."),
    "spec_accept_rate": ("spec_accept_rate", "Speculative decoding: accepted / drafted tokens since start."),
}
_RUNTIME_COUNTERS = {
    "num_preemptions": ("preemptions", "Running requests preempted by more urgent ones."),
    "num_retractions": ("retractions", "Running requests retracted to the queue for lack of KV memory."),
    "spec_num_drafts": ("spec_verifications", "Speculative decoding: drafts verified (one per request and step)."),
    "spec_draft_tokens": ("spec_draft_tokens", "Speculative decoding: draft tokens verified."),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Speculative decoding: draft tokens accepted."),
}


MAX_PRIORITY_LABELS = 16
OTHER_PRIORITIES = "other"


class PriorityLabels:
    """The `priority` label value of a request: its priority while fewer than `limit` distinct ones
    have been seen (a deployment's few classes), then "other" for any new one."""

    def __init__(self, limit: int = MAX_PRIORITY_LABELS) -> None:
        self.limit = limit
        self._seen: set[int] = set()

    def __call__(self, priority: int | None) -> str:
        if priority is None:
            return "none"
        if priority not in self._seen:
            if len(self._seen) >= self.limit:
                return OTHER_PRIORITIES
            self._seen.add(priority)
        return str(priority)


class RuntimeStatsCollector(Collector):
    """Exports the latest runtime stats snapshot (set by `update` right before each scrape)."""

    def __init__(self) -> None:
        self._stats: dict[str, Any] | None = None
        self._local_hit_rate = 0.0

    def update(self, stats: dict[str, Any] | None, local_hit_rate: float) -> None:
        self._stats = stats
        self._local_hit_rate = local_hit_rate

    def collect(self) -> Iterable[Metric]:
        stats = self._stats
        yield GaugeMetricFamily(PREFIX + "runtime_up", "1 when the runtime answered the last scrape.",
                                value=0 if stats is None else 1)
        if stats is None:
            return
        for key, (name, doc) in _RUNTIME_GAUGES.items():
            if _is_number(stats.get(key)):
                yield GaugeMetricFamily(PREFIX + name, doc, value=stats[key])
        if _is_number(stats.get("slots_total")) and _is_number(stats.get("slots_free")):
            yield GaugeMetricFamily(PREFIX + "kv_slots_used", "KV slots holding tokens (requests' or cached).",
                                    value=stats["slots_total"] - stats["slots_free"])
        for key, (name, doc) in _RUNTIME_COUNTERS.items():
            if _is_number(stats.get(key)):
                yield CounterMetricFamily(PREFIX + name, doc, value=stats[key])
        length = spec_accept_length(stats)
        if length is not None:
            yield GaugeMetricFamily(PREFIX + "spec_accept_length",
                                    "Speculative decoding: accepted draft tokens per verification since start.", value=length)
        yield GaugeMetricFamily(PREFIX + "cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.",
                                value=_runtime_hit_rate(stats, self._local_hit_rate))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)



def _runtime_hit_rate(stats: dict[str, Any], fallback: float) -> float:
    """The runtime's own rate (all its clients); the front's (its requests only) if it reports none."""
    return float(stats["cache_hit_rate"]) if _is_number(stats.get("cache_hit_rate")) else fallback


class HttpMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "http_requests", "HTTP generation requests by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens of finished requests.", registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_tokens", "Prompt tokens served from the prefix cache.", registry=r)
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first output token.",
                                             ["priority"], buckets=_FIRST_TOKEN_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                                             ["priority"], buckets=_INTER_TOKEN_BUCKETS, registry=r)
        self.e2e_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
                                     ["priority"], buckets=_E2E_BUCKETS, registry=r)
        self.queue_wait = Histogram(PREFIX + "queue_time_seconds", "Time a request waited in the runtime's queue.",
                                    ["priority"], buckets=_FIRST_TOKEN_BUCKETS, registry=r)
        self._prompt_total = 0
        self._cached_total = 0
        self.priority_label = PriorityLabels()
        self.runtime_stats = RuntimeStatsCollector()
        r.register(self.runtime_stats)
        self.sglang = SglangMetrics()
        r.register(self.sglang)

    def observe_first_token(self, label: str, seconds: float) -> None:
        self.time_to_first_token.labels(priority=label).observe(seconds)
        self.sglang.time_to_first_token.observe(seconds)

    def observe_inter_token(self, label: str, seconds: float, count: int) -> None:
        """`count` tokens that arrived together, `seconds` apart from the previous one each."""
        ours, theirs = self.inter_token_latency.labels(priority=label), self.sglang.inter_token_latency
        for _ in range(count):
            ours.observe(seconds)
            theirs.observe(seconds)

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def observe_finished(self, meta_info: dict[str, Any], label: str, e2e_seconds: float) -> None:
        self.e2e_latency.labels(priority=label).observe(e2e_seconds)
        self.sglang.e2e_request_latency.observe(e2e_seconds)
        queue_time = meta_info.get("queue_time")
        if isinstance(queue_time, (int, float)):
            self.queue_wait.labels(priority=label).observe(queue_time)
            self.sglang.queue_time.observe(queue_time)
        prompt, cached = int(meta_info.get("prompt_tokens") or 0), int(meta_info.get("cached_tokens") or 0)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(int(meta_info.get("completion_tokens") or 0))
        self.cached_tokens.inc(cached)
        self._prompt_total += prompt
        self._cached_total += cached

    def local_hit_rate(self) -> float:
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def render(self, server_info: dict[str, Any] | None, model_name: str | None = None) -> bytes:
        """The exposition text; `server_info` is the runtime's, or None when it did not answer;
        `model_name` labels the sglang:* metrics (SGLang's served model name)."""
        stats = None if server_info is None else server_info.get("stats", server_info)
        self.runtime_stats.update(stats, self.local_hit_rate())
        self.sglang.update(stats, model_name or (server_info or {}).get("served_model_name"))
        return generate_latest(self.registry)
