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
from test_scheduler import CharTokenizer, expected, make, prompt_of, req, run_to_end

from sgl_lite.runtime.managers.in_batch_sharing import BatchPrefixIndex
from sgl_lite.runtime.managers.request import FinishKind
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.testing.hf_reference import hf_greedy, hf_model


def test_batch_prefix_index_names_the_earliest_holder_within_limits() -> None:
    shared = list(range(100, 140))  # 40 tokens
    index = BatchPrefixIndex(min_tokens=16)
    index.add(shared + [1, 2, 3], 43, 0)
    b1 = index.borrow(shared + [4, 5], 0, 41)
    assert b1 is not None and b1.lenders.tolist() == [0] * 40
    index.add(shared + [4, 5], 42, 1)
    b2 = index.borrow(shared + [4, 5] + [6] * 30, 0, 71)  # 40 from plan 0, then 2 from plan 1
    assert b2 is not None and b2.lenders.tolist() == [0] * 40 + [1] * 2
    assert index.borrow(shared + [7], 0, 10) is None  # may share only 10 (< 16)
    assert index.borrow(shared[:20] + [8] * 5, 20, 24) is None  # its own prefix covers the shared part
    b3 = index.borrow(shared + [9], 10, 40)  # from its prefix on, up to what it may share
    assert b3 is not None and b3.lenders.tolist() == [0] * 30
    assert index.borrow(list(range(500, 540)), 0, 39) is None  # nothing in common
    index.add(shared[:30], 20, 2)  # held range shorter than the key
    assert BatchPrefixIndex().borrow(shared, 0, 39) is None  # empty index


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
    assert sched.kv.tree_cache.total_size() == 40 + sum(len(r.input_ids) - 40 + 6 - 1 for r in reqs)
    again = req("b", shared + [9, 9], max_new=3)
    sched.add_request(again)
    run_to_end(sched)
    assert again.cached_tokens == 40 and again.output_ids == expected(again)


def test_borrower_of_a_continuing_chunk_and_finishing_lender() -> None:
    # SGLang's order, the chunk first in every round (with fair prefill the borrower's arrival makes the next
    # round shared, where it goes first and computes [100, 130) itself).
    sched, runner = make(chunked_prefill_size=100, disable_fair_prefill=True)
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
        reference = hf_model(tiny_llama_dir)
        for prompt, out in zip(prompts, outs):
            assert out["output_ids"] == hf_greedy(reference, prompt, 8)
        engine.core.scheduler.check_invariant()
    finally:
        engine.shutdown()


def test_borrowed_tokens_leave_room_in_the_chunk_budget() -> None:
    # 8 x (256 shared + 64) = 2560 prompt tokens against a 2048-token chunk: computing the shared part
    # once (256 + 8 x 64 = 768) fits, so all eight run in one forward and none is chunked.
    sched, runner = make(chunked_prefill_size=2048)
    shared = prompt_of(6, 256)
    reqs = [req(f"s{i}", shared + [10 + i] + prompt_of(60 + i, 63), max_new=3) for i in range(8)]  # tails differ at once
    for r in reqs:
        sched.add_request(r)
    run_to_end(sched)
    first = _prefill_records(runner)[0]
    assert first.rids == [r.rid for r in reqs]
    assert first.extend_lens == [320] + [64] * 7
    assert [r.cached_tokens for r in reqs] == [0] + [256] * 7
    assert all(r.output_ids == expected(r) for r in reqs)


def test_a_chunked_request_can_borrow() -> None:
    sched, runner = make(chunked_prefill_size=300)
    shared = prompt_of(7, 200)
    a, b = req("a", shared + prompt_of(70, 40), max_new=3), req("b", shared + prompt_of(71, 150), max_new=3)
    for r in (a, b):
        sched.add_request(r)
    run_to_end(sched)
    first, second = _prefill_records(runner)[:2]
    # a computes 240; b borrows 200 and computes the 60 the chunk has left; then b's remaining 90.
    assert first.rids == ["a", "b"] and first.prefix_lens == [0, 200] and first.extend_lens == [240, 60]
    assert second.rids == ["b"] and second.prefix_lens == [260] and second.extend_lens == [90]
    assert b.cached_tokens == 200 and b.output_ids == expected(b) and a.output_ids == expected(a)


def _no_slot_twice_on_the_free_list(sched) -> None:
    free = sched.kv.allocator._free.tolist()
    assert len(free) == len(set(free)), "a slot is on the free list twice (double free)"


def test_lender_slots_freed_as_duplicates_are_not_freed_again_by_the_borrower_mixed() -> None:
    # D decodes the tokens A and B then share; with mixed chunks D finishes (its outputs enter the tree)
    # in the same forward, before A's insert, so A frees its copy of those 18 tokens as duplicates.
    sched, runner = make(enable_mixed_chunk=True)
    prompt = prompt_of(1, 20)
    d = req("D", prompt, max_new=20, ignore_eos=True)
    sched.add_request(d)
    while len(d.output_ids) < 19:
        sched.step()
    a = req("A", d.fill_ids[:38] + prompt_of(2, 5), max_new=4, ignore_eos=True)
    b = req("B", d.fill_ids[:38] + prompt_of(3, 5), max_new=4, ignore_eos=True)
    for r in (a, b):
        sched.add_request(r)
    sched.step()
    assert runner.records[-1].rids == ["A", "B", "D"] and runner.records[-1].prefix_lens == [20, 38, 38]
    assert d.finished
    _no_slot_twice_on_the_free_list(sched)
    sched.check_invariant()
    done = run_to_end(sched)
    assert done["A"].output_ids == expected(a) and done["B"].output_ids == expected(b)


def test_lender_slots_freed_as_duplicates_are_not_freed_again_by_the_borrower_preemption() -> None:
    # Same, with the tree gaining V's outputs during admission: V is preempted to give C a row.
    sched, runner = make(max_running_requests=3, enable_priority_scheduling=True)
    v = req("V", prompt_of(1, 20), max_new=40, priority=0, ignore_eos=True)
    sched.add_request(v)
    while len(v.output_ids) < 20:
        sched.step()
    a = req("A", v.fill_ids[:38] + prompt_of(2, 5), max_new=4, priority=100, ignore_eos=True)
    b = req("B", v.fill_ids[:38] + prompt_of(3, 5), max_new=4, priority=100, ignore_eos=True)
    c = req("C", prompt_of(4, 6), max_new=4, priority=100, ignore_eos=True)
    for r in (a, b, c):
        sched.add_request(r)
    sched.step()
    assert sched.num_preemptions == 1 and runner.records[-1].prefix_lens[:2] == [20, 38]
    _no_slot_twice_on_the_free_list(sched)
    sched.check_invariant()
    done = run_to_end(sched)
    assert all(done[r.rid].output_ids == expected(r) for r in (a, b, c, v))
