"""In-batch prefix sharing: requests of one prefill batch read the KV an earlier one computes.

The fake runner stores each slot's token and position and fails when a request's row holds other
tokens than its fill_ids, so a wrong borrowed slot fails the test; the Engine test checks the real
model's tokens against transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fake_runner import FakeRunner
from sgl_lite.runtime.engine import Engine
from sgl_lite.runtime.in_batch_sharing import SharePlan, find_borrows
from sgl_lite.runtime.request import FinishKind
from sgl_lite.runtime.scheduler import Scheduler
from sgl_lite.runtime.server_args import ServerArgs
from test_engine import hf_greedy
from test_scheduler import CharTokenizer, expected, make, prompt_of, req, run_to_end


def test_find_borrows_picks_earliest_holder_within_limits() -> None:
    shared = list(range(100, 140))  # 40 tokens
    parts = [
        SharePlan(shared + [1, 2, 3], 0, 43, 42),
        SharePlan(shared + [4, 5], 0, 42, 41),  # borrows 40 from part 0
        SharePlan(shared + [4, 5] + [6] * 30, 0, 72, 71),  # 40 from part 0, then 2 from part 1
        SharePlan(shared + [7], 0, 41, 10),  # may share only 10 (< 16): no borrow
        SharePlan(shared[:20] + [8] * 5, 20, 5, 24),  # its tree prefix covers the shared part
        SharePlan(list(range(500, 540)), 0, 40, 39),  # nothing in common
    ]
    borrows = find_borrows(parts, min_tokens=16)
    assert borrows[0] is None and borrows[3] is None and borrows[4] is None and borrows[5] is None
    assert borrows[1] is not None and borrows[1].lenders.tolist() == [0] * 40
    assert borrows[2] is not None and borrows[2].lenders.tolist() == [0] * 40 + [1] * 2
    assert find_borrows(parts[:1]) == [None]


def _prefill_records(runner: FakeRunner) -> list:
    return [r for r in runner.records if not r.is_decode]


@pytest.mark.parametrize("disable", [False, True])
def test_requests_arriving_together_compute_the_shared_prefix_once(disable: bool) -> None:
    sched, runner = make(disable_in_batch_prefix_sharing=disable)
    shared = prompt_of(1, 40)
    reqs = [req(f"a{i}", shared + prompt_of(10 + i, 5 + i), max_new=6) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    done = run_to_end(sched)
    assert all(done[r.rid].output_ids == expected(r) for r in reqs)
    first = _prefill_records(runner)[0]
    assert first.rids == [r.rid for r in reqs]  # one prefill batch
    if disable:
        assert first.prefix_lens == [0] * 4
        assert [r.cached_tokens for r in reqs] == [0] * 4
    else:
        assert first.prefix_lens == [0, 40, 40, 40]
        assert first.extend_lens == [len(r.input_ids) - p for r, p in zip(reqs, first.prefix_lens)]
        assert [r.cached_tokens for r in reqs] == [0, 40, 40, 40]
    # Either way the tree ends holding the shared part once.
    # (a finished request's last output token has no KV)
    assert sched.tree_cache.total_size() == 40 + sum(len(r.input_ids) - 40 + 6 - 1 for r in reqs)
    again = req("b", shared + [9, 9], max_new=3)
    sched.add_request(again)
    run_to_end(sched)
    assert again.cached_tokens == 40 and again.output_ids == expected(again)


def test_borrower_of_a_continuing_chunk_and_finishing_lender() -> None:
    sched, runner = make(chunked_prefill_size=100)
    lender = req("lender", prompt_of(2, 150), max_new=1)  # finishes on its first token
    sched.add_request(lender)
    sched.step()  # chunk [0, 100)
    borrower = req("borrower", lender.input_ids[:130] + prompt_of(3, 4), max_new=5)
    sched.add_request(borrower)
    done = run_to_end(sched)
    second = _prefill_records(runner)[1]
    assert second.rids == ["lender", "borrower"]
    # The tree held the first chunk; the borrower read [100, 130) from the lender's second chunk.
    assert second.prefix_lens == [100, 130] and borrower.cached_tokens == 130
    assert done["lender"].output_ids == expected(lender)
    assert done["borrower"].output_ids == expected(borrower)


def test_logprob_positions_are_computed_not_borrowed() -> None:
    sched, runner = make()
    shared = prompt_of(4, 40)
    a = req("a", shared + [5, 6], max_new=2)
    b = req("b", shared + [7, 8], max_new=2)
    b.return_logprob, b.logprob_start_len = True, 10
    for r in (a, b):
        sched.add_request(r)
    run_to_end(sched)
    assert _prefill_records(runner)[0].prefix_lens == [0, 0]  # only 9 shareable tokens (< 16)
    assert len(b.input_token_logprobs) == len(b.input_ids) - 10


class FailingOnceRunner(FakeRunner):
    def forward(self, batch):
        if not batch.is_decode and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("injected")
        return super().forward(batch)


def test_failed_sharing_batch_aborts_its_requests_and_leaks_nothing() -> None:
    runner = FailingOnceRunner(num_slots=4096, max_running_requests=32, context_length=1024, vocab_size=64)
    sched = Scheduler(ServerArgs(chunked_prefill_size=-1), runner, tokenizer=CharTokenizer(), eos_token_ids=(1,),
                      context_length=1024)
    shared = prompt_of(5, 40)
    reqs = [req(f"f{i}", shared + [10 + i], max_new=3) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    done = run_to_end(sched)
    assert all(done[r.rid].finished_reason.kind is FinishKind.ABORT for r in reqs)
    sched.check_invariant()
    retry = [req(f"g{i}", shared + [10 + i], max_new=3) for i in range(3)]
    for r in retry:
        sched.add_request(r)
    run_to_end(sched)
    assert all(r.output_ids == expected(r) for r in retry)


def test_engine_batch_sharing_a_prefix_matches_transformers(tiny_llama_dir: Path) -> None:
    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, dtype="float32", device="cpu")
    try:
        ids = torch.Generator().manual_seed(7)
        shared = torch.randint(3, 200, (48,), generator=ids).tolist()
        prompts = [shared + torch.randint(3, 200, (3 + i,), generator=ids).tolist() for i in range(3)]
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 48, 48]
        for prompt, out in zip(prompts, outs):
            assert out["output_ids"] == hf_greedy(tiny_llama_dir, prompt, 8)
        engine.core.scheduler.check_invariant()
    finally:
        engine.shutdown()
