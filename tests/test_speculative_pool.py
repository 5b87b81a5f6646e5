"""N-gram drafts from the shared pool of recent outputs (--speculative-ngram-capacity)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.speculative.ngram_pool import SEPARATOR, NgramPool
from sgl_lite.runtime.speculative.ngram_proposer import NgramProposer, suffix_match

# Tests of verification, not of the draft-length policy (conftest.py).
pytestmark = pytest.mark.usefixtures("draft_lengths_from_the_prior")


def req_with(prompt: list[int], output: list[int] = ()) -> Req:
    req = Req(rid="r", input_ids=list(prompt), sampling_params=SamplingParams())
    req.output_ids = list(output)
    return req


def test_pool_keeps_the_newest_outputs_within_capacity() -> None:
    pool = NgramPool(capacity=10)
    pool.add([1, 2, 3])
    pool.add([4, 5, 6, 7])
    assert pool.joined().tolist() == [1, 2, 3, SEPARATOR, 4, 5, 6, 7, SEPARATOR] and pool.size == 9
    pool.add([8, 9])  # 12 > 10: the oldest output goes whole
    assert pool.joined().tolist() == [4, 5, 6, 7, SEPARATOR, 8, 9, SEPARATOR]
    pool.add(list(range(100, 130)))  # longer than the pool: its tail
    assert pool.joined().tolist() == list(range(121, 130)) + [SEPARATOR] and pool.size == 10
    pool.clear()
    assert pool.size == 0 and pool.joined().size == 0
    with pytest.raises(ValueError, match="--speculative-ngram-capacity"):
        NgramPool(0)


def brute_force_pool_match(tokens: list[int], pool: list[int], min_window: int, max_window: int) -> tuple[int, int] | None:
    for n in range(min(max_window, len(tokens)), min_window - 1, -1):
        for end in range(len(pool), n - 1, -1):
            if pool[end - n : end] == tokens[len(tokens) - n :]:
                return end, n
    return None


def test_a_suffix_looked_up_in_the_pool_equals_brute_force() -> None:
    rng = random.Random(1)
    for case in range(400):
        alphabet = 3 if case % 2 else 8
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 12))]
        pool = [rng.choice([SEPARATOR] + list(range(alphabet))) for _ in range(rng.randrange(0, 60))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 8)
        found = suffix_match(np.array(tokens), lo, hi, haystack=np.array(pool, dtype=np.int64))
        assert found == brute_force_pool_match(tokens, pool, lo, hi), (tokens, pool, lo, hi)


def test_a_request_without_its_own_match_drafts_from_other_requests_outputs() -> None:
    proposer = NgramProposer(num_draft_tokens=4, min_window=1, max_window=4, pool_capacity=100)
    without_pool = NgramProposer(num_draft_tokens=4, min_window=1, max_window=4)
    earlier = req_with([9, 9], [50, 51, 52, 53, 54])
    for p in (proposer, without_pool):
        p.remember(earlier)
    req = req_with([1, 2, 3], [50, 51])  # its own tokens never repeat
    assert without_pool.propose(req, limit=10) == []
    assert proposer.propose(req, limit=10) == [52, 53, 54]  # cut where that output ended
    own = req_with([7, 8, 60, 61, 7, 8], [])
    assert proposer.propose(own, limit=2) == [60, 61]  # its own (longer) match first
    # Its own context matches only the last token (51); the pool matches "50 51": the pool wins.
    longer = req_with([51, 99, 3], [50, 51])
    assert without_pool.propose(longer, limit=2) == [99, 3]
    assert proposer.propose(longer, limit=2) == [52, 53]
    # The pool's longer match ends its output ("52 53 54" then the separator): nothing follows it there,
    # so the request's own draft stands.
    ending = req_with([54, 77, 3], [53, 54])
    assert proposer.propose(ending, limit=2) == [77, 3]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path):
    common = dict(model_path=str(tiny_llama_dir), max_total_tokens=4096, max_running_requests=8,
                  dtype="float32", device="cpu")
    plain = Engine(**common)
    pooled = Engine(**common, speculative_algorithm="ngram", speculative_ngram_capacity=4096,
                    speculative_ngram_min_match_window_size=2)
    yield plain, pooled
    for eng in (plain, pooled):
        eng.shutdown()


def test_pool_drafts_keep_greedy_output_and_leak_nothing(engines) -> None:
    plain, pooled = engines
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    prompts = ["alpha beta gamma delta", "alpha beta gamma delta epsilon"]
    first = pooled.generate(prompts[0], params)
    # The second prompt's answer starts like the first's: its drafts come from the pool.
    drafted_before = pooled.core.scheduler.stats()["spec_draft_tokens"]
    assert pooled.core.scheduler.stats()["spec_pool_drafts"] == 0
    second = pooled.generate(prompts[1], params)
    assert first["output_ids"] == plain.generate(prompts[0], params)["output_ids"]
    assert second["output_ids"] == plain.generate(prompts[1], params)["output_ids"]
    assert pooled.core.scheduler.proposer.pool.size > 0
    stats = pooled.core.scheduler.stats()
    assert stats["spec_draft_tokens"] > drafted_before and stats["spec_pool_drafts"] > 0
    for eng in engines:
        eng.core.scheduler.check_invariant()  # the no-leak invariant (testing/kv_accounting.py's, in process)
        assert not eng.core.scheduler.has_work()
    assert pooled.flush_cache() and pooled.core.scheduler.proposer.pool.size == 0
