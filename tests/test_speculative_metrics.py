"""Speculative decoding in /metrics: a real runtime's stats through both exporters (sgl_lite_* and sglang:*)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sgl_lite.http.metrics import RuntimeStatsCollector
from sgl_lite.http.sglang_metrics import SglangMetrics
from sgl_lite.runtime.server.engine import Engine

# Tests of verification, not of the draft-length policy (conftest.py).
pytestmark = pytest.mark.usefixtures("draft_lengths_from_the_prior")


def scrape(stats: dict) -> dict[str, float]:
    registry = CollectorRegistry()
    runtime, sglang = RuntimeStatsCollector(), SglangMetrics()
    registry.register(runtime)
    registry.register(sglang)
    runtime.update(stats, 0.0)
    sglang.update(stats, "tiny")
    text = generate_latest(registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path):
    eng = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, dtype="float32", device="cpu",
                 speculative_algorithm="ngram")
    yield eng
    eng.shutdown()


def test_accepted_tokens_per_step_and_acceptance_rate_are_exported(engine) -> None:
    before = engine.core.scheduler.stats()["generated_tokens_total"]
    out = engine.generate("one two three four five one two three four five one two three",
                          {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
    stats = engine.core.scheduler.stats()
    # Generated tokens count every accepted draft token, not one per verification.
    assert stats["generated_tokens_total"] - before == len(out["output_ids"]) == 40
    verified, drafted, accepted = stats["spec_num_drafts"], stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    assert verified > 0 and accepted > 0
    got = scrape(stats)
    assert got["sgl_lite_spec_verifications_total"] == verified
    assert got["sgl_lite_spec_draft_tokens_total"] == drafted
    assert got["sgl_lite_spec_accepted_tokens_total"] == accepted
    assert got["sgl_lite_spec_accept_length"] == pytest.approx(accepted / verified)
    assert got["sgl_lite_spec_accept_rate"] == pytest.approx(accepted / drafted)
    # SGLang's accept length counts the model's own token of each verification too.
    assert got["sglang:spec_accept_length"] == pytest.approx(1 + accepted / verified)
    assert got["sglang:spec_accept_rate"] == pytest.approx(accepted / drafted)
    engine.core.scheduler.check_invariant()  # the no-leak invariant (testing/kv_accounting.py's, in process)


def test_no_speculative_series_without_speculation() -> None:
    got = scrape({"num_running": 0, "slots_total": 10, "slots_free": 10})
    assert not [name for name in got if "spec_" in name]
