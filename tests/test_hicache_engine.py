"""The disk tier end to end on the tiny model: KV spilled and loaded back gives the greedy tokens of a server that
never evicted; restarts find it; bad files, a full tier, failing I/O and aborts cost recomputation, never a request."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from sgl_lite.http.sglang_metrics import SglangMetrics
from sgl_lite.runtime.mem_cache.hicache.block_keys import block_keys
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.testing.tiny_model import make_tiny_model

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
POOL = dict(max_total_tokens=700, dtype="float32", device="cpu", chunked_prefill_size=128)


def prompts(n: int = 5, length: int = 300, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    """Greedy outputs of a pool that holds every prompt at once (nothing evicted, no tier)."""
    engine = Engine(model_path=str(tiny_llama_dir), **{**POOL, "max_total_tokens": 4096})
    try:
        return [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts()]
    finally:
        engine.shutdown()


def tier_engine(model: Path, folder: Path, **kwargs) -> Engine:
    return Engine(model_path=str(model), enable_hierarchical_cache=True, hicache_storage_dir=str(folder),
                  **{**POOL, **kwargs})


def run_all(engine: Engine) -> list[dict]:
    outs = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts()]
    engine.core.check_invariant()
    return outs


def storage_tokens(outs: list[dict]) -> list[int]:
    return [o["meta_info"]["cached_tokens_details"]["storage"] for o in outs]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_spilled_and_reloaded_kv_gives_the_same_tokens_and_survives_a_restart(
        tiny_llama_dir: Path, tmp_path: Path, reference: list[list[int]], policy: str) -> None:
    engine = tier_engine(tiny_llama_dir, tmp_path, hicache_write_policy=policy)
    first = run_all(engine)  # the pool holds two prompts: each new one evicts an older one
    assert [o["output_ids"] for o in first] == reference
    engine.core.tier.drain()
    second = run_all(engine)  # every prompt's KV is gone from the pool by its turn: it comes from disk
    assert [o["output_ids"] for o in second] == reference
    assert all(n >= 256 for n in storage_tokens(second)), storage_tokens(second)
    stats = engine.core.server_info()
    assert stats["hicache_loaded_tokens_total"] >= 5 * 256 and stats["hicache_disk_blocks"] >= 5 * 4
    assert stats["slots_protected"] == 0
    for part in ("hicache_load_read_seconds_total", "hicache_load_copy_seconds_total"):  # parts of each load's time
        assert 0 < stats[part] < stats["hicache_load_seconds_total"], (part, stats)
    metrics = SglangMetrics()
    metrics.update(stats, "tiny")
    samples = {s.name: s.value for family in metrics.collect() for s in family.samples}
    assert samples["sglang:hicache_loaded_tokens_total"] == stats["hicache_loaded_tokens_total"]
    assert samples["sglang:hicache_disk_bytes"] == stats["hicache_disk_bytes"] > 0
    assert samples["sglang:hicache_load_copy_seconds_total"] == stats["hicache_load_copy_seconds_total"]
    engine.shutdown()

    restarted = tier_engine(tiny_llama_dir, tmp_path, hicache_write_policy=policy)
    try:
        out = restarted.generate(input_ids=prompts()[0], sampling_params=GREEDY)
        assert out["output_ids"] == reference[0]
        assert storage_tokens([out]) == [256]  # the first request after the restart is served from disk
    finally:
        restarted.shutdown()


def test_another_models_files_are_never_loaded(tiny_llama_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "tier"
    engine = tier_engine(tiny_llama_dir, store)
    run_all(engine)
    engine.shutdown()
    other = make_tiny_model(tmp_path / "other", seed=7)  # same architecture and tokenizer, other weights
    want = Engine(model_path=str(other), **POOL)
    expected = [want.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts()[:2]]
    want.shutdown()
    engine = tier_engine(other, store)
    try:
        outs = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts()[:2]]
        assert storage_tokens(outs) == [0, 0] and [o["output_ids"] for o in outs] == expected
        assert len(list(store.iterdir())) == 2  # a folder per model fingerprint
    finally:
        engine.shutdown()


def test_truncated_files_are_recomputed_and_dropped(tiny_llama_dir: Path, tmp_path: Path,
                                                    reference: list[list[int]]) -> None:
    engine = tier_engine(tiny_llama_dir, tmp_path)
    run_all(engine)
    engine.shutdown()
    files = sorted(tmp_path.glob("*/*.kv"))
    for path in files:
        path.write_bytes(path.read_bytes()[:-7])
    engine = tier_engine(tiny_llama_dir, tmp_path)
    try:
        out = engine.generate(input_ids=prompts()[0], sampling_params=GREEDY)
        assert out["output_ids"] == reference[0] and storage_tokens([out]) == [0]
        assert engine.core.server_info()["hicache_io_errors_total"] == 0  # bad content, not a failed read
        engine.core.check_invariant()
    finally:
        engine.shutdown()


def test_a_full_tier_keeps_its_bound_and_serves_everyone(tiny_llama_dir: Path, tmp_path: Path,
                                                         reference: list[list[int]]) -> None:
    engine = tier_engine(tiny_llama_dir, tmp_path, hicache_size=150_000 / 2**30)  # room for about 4 blocks
    try:
        for _ in range(2):
            assert [o["output_ids"] for o in run_all(engine)] == reference
        engine.core.tier.drain()
        info = engine.core.server_info()
        assert 0 < info["hicache_disk_bytes"] <= 150_000
        assert sum(p.stat().st_size for p in tmp_path.glob("*/*.kv")) == info["hicache_disk_bytes"]
    finally:
        engine.shutdown()


def test_failing_disk_io_costs_recomputation_only(tiny_llama_dir: Path, tmp_path: Path, reference: list[list[int]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGL_LITE_FAULT_INJECT", "disk_io:3")
    engine = tier_engine(tiny_llama_dir, tmp_path)
    try:
        for _ in range(3):
            assert [o["output_ids"] for o in run_all(engine)] == reference
            engine.core.tier.drain()
        info = engine.core.server_info()
        assert info["hicache_io_errors_total"] > 0 and info["hicache_loaded_tokens_total"] > 0
    finally:
        engine.shutdown()


def test_abort_during_a_load_and_two_requests_on_one_loading_prefix(tiny_llama_dir: Path, tmp_path: Path,
                                                                    reference: list[list[int]]) -> None:
    engine = tier_engine(tiny_llama_dir, tmp_path)
    core = engine.core
    try:
        run_all(engine)
        core.tier.drain()
        gate = threading.Event()
        core.tier.store._fault = lambda op, key: gate.wait(30) if op == "read" else None  # reads wait for the test
        p = prompts()
        reqs = [core.make_req(rid, None, ids, GREEDY) for rid, ids in (("gone", p[0]), ("a", p[1]), ("b", p[1]))]
        for req in reqs:
            core.submit(req)
        for _ in range(3):
            core.step()
        assert len(core.scheduler.tier_loads) == 3 and all(r.tier_hold is not None for r in reqs)
        assert core.abort("gone")
        gate.set()
        done = {}
        while core.has_work():
            for req in core.step():
                if req.finished:
                    done[req.rid] = req
        assert done["gone"].finished_reason.kind.value == "abort"
        assert done["a"].output_ids == reference[1] and done["b"].output_ids == reference[1]
        # One load installed the prefix; the other request found it in the tree (or loaded nothing new).
        assert done["a"].tier_loaded_tokens + done["b"].tier_loaded_tokens >= 256
        core.check_invariant()  # the aborted load's slots freed, the duplicate load's too
        assert core.scheduler.stats()["slots_protected"] == 0 and core.scheduler.stats()["slots_loading"] == 0
    finally:
        core.tier.store._fault = None
        engine.shutdown()


@pytest.mark.timeout(120)  # a load that waited on its own hold would never finish
def test_a_load_larger_than_half_the_pool_beside_its_own_cached_prefix(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Two sessions share a system prompt; each one's context is over half the pool. A returning session matches
    the shared prefix in the tree (its own hold) and loads the rest: it must not wait on its own hold."""
    rng = random.Random(5)
    system = [rng.randrange(5, 300) for _ in range(128)]
    sessions = [system + [rng.randrange(5, 300) for _ in range(392)] for _ in range(2)]
    want = Engine(model_path=str(tiny_llama_dir), **{**POOL, "max_total_tokens": 4096})
    expected = [want.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in sessions]
    want.shutdown()
    engine = tier_engine(tiny_llama_dir, tmp_path)
    try:
        for _ in range(2):
            outs = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in sessions]
            assert [o["output_ids"] for o in outs] == expected
            engine.core.tier.drain()
        details = outs[0]["meta_info"]["cached_tokens_details"]
        assert details["storage"] > 0 and details["device"] + details["storage"] >= 512
        engine.core.check_invariant()
    finally:
        engine.shutdown()


def test_a_returning_session_loads_its_partial_last_block_and_a_diverging_one_does_not(
        tiny_llama_dir: Path, tmp_path: Path, reference: list[list[int]]) -> None:
    """A turn leaves 305 tokens of KV: four whole 64-token blocks and a partial one of 49. The session's next turn
    (which holds all 305) loads all of it; a request that shares only 34 of the partial block's tokens loads the
    whole blocks alone. Both give the greedy tokens of a server that never evicted."""
    p = prompts()
    turn_kv = p[0] + reference[0][:-1]  # the last output token's KV is never computed
    returning = p[0] + reference[0] + [7] * 40
    diverging = turn_kv[:290] + [9] * 20
    want = Engine(model_path=str(tiny_llama_dir), **{**POOL, "max_total_tokens": 4096})
    expected = [want.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in (diverging, returning)]
    want.shutdown()

    engine = tier_engine(tiny_llama_dir, tmp_path)

    def evict_the_first_turn() -> None:  # four other prompts through a 700-token pool
        for other in p[1:]:
            engine.generate(input_ids=other, sampling_params=GREEDY)
        engine.core.tier.drain()

    try:
        assert engine.generate(input_ids=p[0], sampling_params=GREEDY)["output_ids"] == reference[0]
        engine.core.tier.drain()
        evict_the_first_turn()
        out = engine.generate(input_ids=diverging, sampling_params=GREEDY)
        assert out["output_ids"] == expected[0]
        assert out["meta_info"]["cached_tokens_details"] == {"device": 0, "storage": 256}
        evict_the_first_turn()
        out = engine.generate(input_ids=returning, sampling_params=GREEDY)
        assert out["output_ids"] == expected[1]
        assert out["meta_info"]["cached_tokens_details"] == {"device": 0, "storage": len(turn_kv)}
        engine.core.tier.drain()
        engine.core.check_invariant()
        # The returning turn's whole block [256, 320) superseded the partial block it starts with; the diverging
        # request's partial block at the same place stays.
        diverging_kv = len(diverging) + GREEDY["max_new_tokens"] - 1
        assert [n for _, n in engine.core.tier.store.partials(block_keys(turn_kv, block_tokens=64)[3])] == [diverging_kv - 256]
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)  # before the fix each load waited on the other's hold for ever
def test_two_loads_that_each_fit_only_without_the_others_hold_both_finish(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Two returning sessions share a system prompt the tree still holds and arrive together: each one's hold
    locks the system prompt while its load reads, and each load fits half the pool beside queued requests' holds
    but not beside the other load's hold. Holds of requests still loading are not released by admitting anyone,
    so neither load may wait on the other."""
    rng = random.Random(5)
    system = [rng.randrange(5, 300) for _ in range(128)]
    sessions = [system + [rng.randrange(5, 300) for _ in range(392)] for _ in range(2)]
    others = [system + [rng.randrange(5, 300) for _ in range(300)] for _ in range(2)]
    want = Engine(model_path=str(tiny_llama_dir), **{**POOL, "max_total_tokens": 4096})
    expected = [want.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in sessions]
    want.shutdown()
    engine = tier_engine(tiny_llama_dir, tmp_path)
    core = engine.core
    try:
        for p in sessions + others:  # the sessions' own tokens are evicted to disk; the system prompt stays
            engine.generate(input_ids=p, sampling_params=GREEDY)
        core.tier.drain()
        reqs = [core.make_req(f"s{i}", None, ids, GREEDY) for i, ids in enumerate(sessions)]
        for req in reqs:
            core.submit(req)
        assert len(core.scheduler.tier_loads) == 2 and core.scheduler.kv.held_tokens == 2 * len(system)
        deadline = time.monotonic() + 30
        while not all(r.finished for r in reqs) and time.monotonic() < deadline:
            if core.has_ready_work():
                core.step()
            else:
                time.sleep(0.002)  # the reads run on the tier's thread
        assert [r.output_ids for r in reqs] == expected
        assert min(r.tier_loaded_tokens for r in reqs) > 0
        core.check_invariant()
        assert core.scheduler.stats()["slots_protected"] == 0
    finally:
        engine.shutdown()


def test_a_chunked_prompt_whose_kv_passes_the_write_backlog_is_stored_whole(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """write_through with a prompt prefilled in chunks writes each chunk's blocks as it goes: a prompt whose KV
    is over the tier's write backlog bound (here 8 blocks; a long context of a 1-2B model passes the default) is
    all on disk when it leaves, not cut at the bound, and a restarted server loads all of it."""
    prompt = prompts(1, length=1200, seed=7)[0]
    engine = tier_engine(tiny_llama_dir, tmp_path, max_total_tokens=2048)
    try:
        tier = engine.core.tier
        tier.max_write_backlog_bytes = 8 * tier.block_bytes
        first = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        tier.drain()
        assert engine.core.server_info()["hicache_write_dropped_tokens_total"] == 0
    finally:
        engine.shutdown()
    restarted = tier_engine(tiny_llama_dir, tmp_path, max_total_tokens=2048)
    try:
        out = restarted.generate(input_ids=prompt, sampling_params=GREEDY)
        assert out["output_ids"] == first["output_ids"]
        assert storage_tokens([out]) == [1200 // 64 * 64]
    finally:
        restarted.shutdown()
