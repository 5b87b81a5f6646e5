"""The scheduler under a randomized workload (eviction, retraction, aborts, every policy) against an
unloaded reference, and a step that raises; test_scheduler.py's fake runner and helpers, its invariant
check after each test."""

from __future__ import annotations

import random

import pytest
from fake_runner import reference_output
from test_scheduler import VOCAB, _invariant_after_each_test, make, prompt_of, req, run_to_end  # noqa: F401 (an autouse fixture)

from sgl_lite.runtime.managers.request import FinishKind, Req

# ---------------------------------------------------------------- randomized


@pytest.mark.parametrize("policy,num_reqs,mixed", [("lpm", 300, False), ("fcfs", 120, False), ("dfs-weight", 120, False),
                                                   ("lof", 120, False), ("random", 120, False), ("lpm", 200, True)])
def test_randomized_workload_with_eviction_retraction_and_aborts(policy: str, num_reqs: int, mixed: bool) -> None:
    rng = random.Random(sum(map(ord, policy)))
    sched, _ = make(slots=160, max_running_requests=12, chunked_prefill_size=16, schedule_policy=policy,
                    random_seed=1, lpm_fallback_threshold=40, schedule_conservativeness=0.3, enable_mixed_chunk=mixed)
    prefixes = [prompt_of(1000 + i, rng.randrange(5, 50)) for i in range(6)]
    reqs: list[Req] = []
    done: dict[str, Req] = {}
    aborted: set[str] = set()
    next_id = 0
    while next_id < num_reqs or sched.has_work():
        for _ in range(rng.randrange(0, 6) if next_id < num_reqs else 0):
            prompt = rng.choice(prefixes) + prompt_of(rng.randrange(10**6), rng.randrange(1, 40))
            r = req(f"q{next_id}", prompt, max_new=rng.randrange(0, 40), ignore_eos=rng.random() < 0.5)
            sched.add_request(r)
            reqs.append(r)
            next_id += 1
        if rng.random() < 0.05 and reqs:
            victim = rng.choice(reqs)
            if sched.abort_request(victim.rid):
                aborted.add(victim.rid)
        for r in sched.step():
            if r.finished:
                assert r.rid not in done
                done[r.rid] = r
        sched.check_invariant()
    assert set(done) == {r.rid for r in reqs}
    assert sched.num_retractions > 0
    # Reference: a huge pool without cache or chunking.
    ref, _ = make(slots=100000, max_running_requests=64, disable_radix_cache=True)
    copies = {r.rid: req(r.rid, r.input_ids, r.sampling_params.max_new_tokens, ignore_eos=r.sampling_params.ignore_eos)
              for r in reqs if r.rid not in aborted}
    for c in copies.values():
        ref.add_request(c)
    run_to_end(ref)
    for rid, c in copies.items():
        assert done[rid].finished_reason.kind is not FinishKind.ABORT
        assert done[rid].output_ids == c.output_ids, rid
    for rid in aborted:
        assert done[rid].finished_reason.kind is FinishKind.ABORT
    sched.check_invariant()


def test_a_step_that_raises_keeps_what_it_had_to_report(monkeypatch) -> None:
    """An abort reported by no step yet (and anything a failing step finished before it raised) is
    reported by the next step: the server loop, which aborts every request after such a failure, then
    answers each client (it lost them with the failing step's list)."""
    sched, _ = make()
    aborted, other = req("aborted", prompt_of(5, 6)), req("other", prompt_of(6, 6))
    sched.add_request(aborted)
    sched.add_request(other)
    assert sched.abort_request("aborted")

    def boom(*args, **kwargs):
        raise RuntimeError("a bug in a step")

    monkeypatch.setattr(sched, "_prefill_batch", boom)
    with pytest.raises(RuntimeError, match="a bug in a step"):
        sched.step()
    monkeypatch.undo()
    assert aborted in sched.step()
    done = run_to_end(sched)
    assert done["other"].output_ids == reference_output(other.input_ids, 8, VOCAB)
