"""--enable-mixed-chunk: running requests decode inside a prefill forward instead of pausing for it."""

from __future__ import annotations

from pathlib import Path

import torch
from test_scheduler import expected, make, prompt_of, req, run_to_end

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.model_executor.model_runner import ModelRunner
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.testing.hf_reference import hf_greedy, hf_model


def mixed_batches(runner) -> list:
    return [r for r in runner.records if not r.is_decode and 1 in r.extend_lens and max(r.extend_lens) > 1]


def test_requests_arriving_during_decode_join_a_mixed_batch() -> None:
    sched, runner = make(enable_mixed_chunk=True)
    first = [req(f"a{i}", prompt_of(i, 20), max_new=10) for i in range(3)]
    for r in first:
        sched.add_request(r)
    sched.step()  # prefill
    sched.step()  # decode
    late = [req(f"b{i}", prompt_of(10 + i, 30), max_new=6) for i in range(2)]
    for r in late:
        sched.add_request(r)
    sched.step()
    record = runner.records[-1]
    assert record.rids == ["b0", "b1", "a0", "a1", "a2"]
    assert record.extend_lens == [30, 30, 1, 1, 1] and record.prefix_lens[2:] == [21, 21, 21]
    done = run_to_end(sched)
    assert all(done[r.rid].output_ids == expected(r) for r in first + late)


def test_without_the_flag_a_prefill_pauses_decoding() -> None:
    sched, runner = make()
    sched.add_request(req("a", prompt_of(1, 20), max_new=10))
    sched.step()
    sched.step()
    sched.add_request(req("b", prompt_of(2, 30), max_new=6))
    run_to_end(sched)
    assert not mixed_batches(runner)


def test_mixed_decode_tokens_come_out_of_the_chunk_budget() -> None:
    sched, runner = make(enable_mixed_chunk=True, chunked_prefill_size=40)
    for i in range(4):
        sched.add_request(req(f"a{i}", prompt_of(i, 8), max_new=20))
    sched.step()
    sched.add_request(req("long", prompt_of(9, 100), max_new=4))
    done = run_to_end(sched)
    for record in mixed_batches(runner):
        assert sum(record.extend_lens) <= 40
    assert mixed_batches(runner), "the long prompt's chunks should have carried the decodes"
    assert done["long"].output_ids == expected(done["long"])


def test_real_model_mixed_batches_match_transformers(tiny_llama_dir: Path) -> None:
    args = ServerArgs(model_path=str(tiny_llama_dir), dtype="float32", device="cpu", max_total_tokens=2048,
                      max_running_requests=8, enable_mixed_chunk=True, chunked_prefill_size=24)
    runner = ModelRunner(args, model_dir=tiny_llama_dir)
    sched = Scheduler(args, runner, context_length=runner.context_length)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (9, 40, 13)]
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]
    sched.add_request(reqs[0])
    sched.step()
    sched.step()
    for r in reqs[1:]:
        sched.add_request(r)
    shapes: list[list[int]] = []
    forward = runner.forward
    runner.forward = lambda batch: (shapes.append(list(batch.extend_lens)), forward(batch))[1]  # type: ignore[method-assign]
    steps = 0
    while sched.has_work():
        sched.step()
        sched.check_invariant()
        steps += 1
        assert steps < 100
    # Each chunk of 24 holds r0's decode token: r1's first 23 + r0; r1's last 17 + r2's first 6 + r0; ...
    assert shapes[:3] == [[23, 1], [17, 6, 1], [7, 1, 1]]
    reference = hf_model(tiny_llama_dir)
    for prompt, r in zip(prompts, reqs):
        assert r.output_ids == hf_greedy(reference, prompt, 8)
