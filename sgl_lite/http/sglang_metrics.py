"""The same measurements under SGLang's metric names, so dashboards made for SGLang read them.

SGLang exports `sglang:*` metrics from two places, and so does this module:
- per-request histograms that its tokenizer manager observes (time to first token, inter-token
  latency, end-to-end latency; and the scheduler's queue time): here the HTTP front observes them for the requests it serves;
- scheduler gauges and token counters: here taken from the runtime's stats at scrape time, so they
  cover every client of the runtime (DSL programs over ZeroMQ included), not only HTTP requests.

Label names are SGLang's: `model_name` (the served model name) and `engine_type` ("unified": no
prefill/decode disaggregation) on every metric, plus `tp_rank` and `pp_rank` on the scheduler's.
The model name is known only once the runtime answered, so the labels are added at scrape time.
Bucket bounds are SGLang's defaults.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "sglang:"
ENGINE_TYPE = "unified"

_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
_QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400,
                  500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)

# Runtime stats key -> (SGLang gauge name, help).
_SCHEDULER_GAUGES = {
    "num_running": ("num_running_reqs", "The number of running requests."),
    "num_waiting": ("num_queue_reqs", "The number of requests in the waiting queue."),
    "num_grammar_pending": ("num_grammar_queue_reqs", "The number of requests in the grammar waiting queue."),
    "num_used_tokens": ("num_used_tokens", "The number of used tokens."),
    "token_usage": ("token_usage", "The token usage."),
    "gen_throughput": ("gen_throughput", "The generation throughput (token/s)."),
    "cache_hit_rate": ("cache_hit_rate", "The prefix cache hit rate."),
    "slots_total": ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    "new_token_ratio": ("new_token_ratio", "The new token ratio."),
    "spec_accept_rate": ("spec_accept_rate", "The average acceptance rate of speculative decoding."),
    # The disk tier (--enable-hierarchical-cache), sgl_lite's own in SGLang's style.
    "num_tier_loading": ("num_hicache_loading_reqs", "The number of requests waiting for their prefix to load from the disk tier."),
    "hicache_disk_blocks": ("hicache_disk_blocks", "KV blocks stored in the disk tier."),
    "hicache_disk_bytes": ("hicache_disk_bytes", "Bytes of KV blocks stored in the disk tier."),
}
# Runtime stats key -> (SGLang counter name without _total, help).
_RUNTIME_COUNTERS = {
    "prompt_tokens_total": ("prompt_tokens", "Number of prefill tokens processed."),
    "generated_tokens_total": ("generation_tokens", "Number of generation tokens processed."),
    "cached_tokens_total": ("cached_tokens", "Number of cached prompt tokens."),
    "num_finished_requests": ("num_requests", "Number of requests processed."),
    "num_aborted_requests": ("num_aborted_requests", "Number of requests aborted."),
    "num_retractions": ("num_retracted_requests", "Total number of retracted requests."),
    # sgl_lite's own, in SGLang's style: grammar-forced output tokens appended without a forward each.
    "jump_forward_tokens_total": ("jump_forward_tokens", "Number of output tokens written by jump-forward decoding."),
    "hicache_loaded_tokens_total": ("hicache_loaded_tokens", "Number of prompt tokens whose KV was loaded from the disk tier."),
    "hicache_spilled_tokens_total": ("hicache_spilled_tokens", "Number of tokens whose KV was written to the disk tier."),
    "hicache_write_dropped_tokens_total": ("hicache_write_dropped_tokens", "Number of tokens not written to the disk tier because its write backlog was full."),
    "hicache_loads_total": ("hicache_loads", "Number of prefix loads from the disk tier."),
    "hicache_load_seconds_total": ("hicache_load_seconds", "Seconds from the start of each prefix load to its KV in the pool, summed."),
    "hicache_load_read_seconds_total": ("hicache_load_read_seconds", "Seconds the disk tier's read thread spent reading and checking the blocks of installed loads, summed."),
    "hicache_load_copy_seconds_total": ("hicache_load_copy_seconds", "Seconds spent copying the blocks of installed loads into the KV pool, summed."),
    "hicache_io_errors_total": ("hicache_io_errors", "Number of disk tier reads and writes that failed (their tokens recomputed)."),
}


class SglangMetrics(Collector):
    """Registered in the front's registry; `update` gives it the runtime's stats right before a scrape."""

    def __init__(self) -> None:
        self.model_name = "default"
        self._stats: dict[str, Any] | None = None
        # Not registered anywhere: `collect` re-emits them with the model labels.
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.",
                                             buckets=_TTFT_BUCKETS, registry=None)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.",
                                             buckets=_ITL_BUCKETS, registry=None)
        self.e2e_request_latency = Histogram(PREFIX + "e2e_request_latency_seconds",
                                             "Histogram of End-to-end request latency in seconds",
                                             buckets=_E2E_BUCKETS, registry=None)
        self.queue_time = Histogram(PREFIX + "queue_time_seconds", "Histogram of queueing time in seconds.",
                                    buckets=_QUEUE_BUCKETS, registry=None)

    def update(self, stats: dict[str, Any] | None, model_name: str | None) -> None:
        self._stats = stats
        if model_name:
            self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        labels = {"model_name": self.model_name, "engine_type": ENGINE_TYPE}
        for histogram in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                          self.queue_time):
            for family in histogram.collect():
                family.samples = [s._replace(labels={**labels, **s.labels}) for s in family.samples]
                yield family
        stats = self._stats
        if stats is None:
            return
        scheduler_labels = {**labels, "tp_rank": "0", "pp_rank": "0"}
        for key, (name, doc) in _SCHEDULER_GAUGES.items():
            if _is_number(stats.get(key)):
                gauge = GaugeMetricFamily(PREFIX + name, doc, labels=list(scheduler_labels))
                gauge.add_metric(list(scheduler_labels.values()), stats[key])
                yield gauge
        length = spec_accept_length(stats)
        if length is not None:  # SGLang's counts the model's own token too: tokens per verification, >= 1
            gauge = GaugeMetricFamily(PREFIX + "spec_accept_length",
                                      "The average acceptance length of speculative decoding.", labels=list(scheduler_labels))
            gauge.add_metric(list(scheduler_labels.values()), length + 1.0)
            yield gauge
        for key, (name, doc) in _RUNTIME_COUNTERS.items():
            if _is_number(stats.get(key)):
                counter = CounterMetricFamily(PREFIX + name, doc, labels=list(labels))
                counter.add_metric(list(labels.values()), stats[key])
                yield counter


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def spec_accept_length(stats: dict[str, Any]) -> float | None:
    """Accepted draft tokens per verification; None when speculation is off (no spec stats)."""
    verified, accepted = stats.get("spec_num_drafts"), stats.get("spec_accepted_tokens")
    if not (_is_number(verified) and _is_number(accepted)):
        return None
    return accepted / verified if verified else 0.0
