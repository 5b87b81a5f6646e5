"""Priority scheduling with the fake runner: preemption threshold and victim choice, resume from cache, queue limits."""

from __future__ import annotations

import pytest
from fake_runner import reference_output
from test_scheduler import VOCAB, _invariant_after_each_test, make, prompt_of, req, run_to_end  # noqa: F401 (autouse fixture)

from sgl_lite.runtime.managers.request import FinishKind
from sgl_lite.runtime.managers.scheduler import QueueFullError


@pytest.mark.parametrize("low_first", [False, True])
def test_preemption_exactly_when_gap_exceeds_threshold(low_first: bool) -> None:
    sign = -1 if low_first else 1
    for gap, preempts in ((10, False), (11, True)):
        sched, _ = make(max_running_requests=1, enable_priority_scheduling=True,
                        schedule_low_priority_values_first=low_first, priority_scheduling_preemption_threshold=10)
        victim = req("victim", prompt_of(70, 8), max_new=30, priority=0, ignore_eos=True)
        sched.add_request(victim)
        for _ in range(4):
            sched.step()
        urgent = req("urgent", prompt_of(71, 6), max_new=3, priority=sign * gap, ignore_eos=True)
        sched.add_request(urgent)
        sched.step()
        assert (urgent in sched.running) == preempts
        assert (victim in sched.waiting) == preempts
        assert sched.num_preemptions == int(preempts)
        done = run_to_end(sched)
        assert done["victim"].output_ids == reference_output(victim.input_ids, 30, VOCAB)
        assert done["urgent"].output_ids == reference_output(urgent.input_ids, 3, VOCAB)
        assert victim.num_preemptions == int(preempts)


def test_preemption_takes_only_as_many_as_needed_and_least_urgent() -> None:
    sched, _ = make(max_running_requests=3, enable_priority_scheduling=True)
    low = [req(f"low{p}", prompt_of(80 + p, 5), max_new=40, priority=p, ignore_eos=True) for p in (0, 1, 2)]
    for r in low:
        sched.add_request(r)
    sched.step()
    assert len(sched.running) == 3
    sched.add_request(req("urgent", prompt_of(90, 5), max_new=2, priority=50))
    sched.step()
    assert sched.num_preemptions == 1
    assert low[0] in sched.waiting and low[1] in sched.running and low[2] in sched.running
    run_to_end(sched)
    assert all(r.output_ids == reference_output(r.input_ids, 40, VOCAB) for r in low)


def test_preempted_request_resumes_from_cache() -> None:
    sched, _ = make(max_running_requests=1, enable_priority_scheduling=True)
    victim = req("victim", prompt_of(91, 30), max_new=20, priority=0, ignore_eos=True)
    sched.add_request(victim)
    for _ in range(6):
        sched.step()
    kv_before = victim.kv_len
    sched.add_request(req("urgent", prompt_of(92, 4), max_new=2, priority=100))
    sched.step()
    assert victim in sched.waiting
    # The victim's computed KV is in the tree: its next admission matches all of it.
    assert sched.kv.tree_cache.match_prefix(victim.fill_ids[:kv_before]).length == kv_before
    run_to_end(sched)
    assert victim.output_ids == reference_output(victim.input_ids, 20, VOCAB)


def test_queue_limit_rejects_and_priority_evicts_worst() -> None:
    sched, _ = make(max_queued_requests=2)
    sched.add_request(req("a", [2, 3]))
    sched.add_request(req("b", [2, 4]))
    with pytest.raises(QueueFullError, match="max-queued-requests"):
        sched.add_request(req("c", [2, 5]))
    run_to_end(sched)

    sched, _ = make(max_queued_requests=2, enable_priority_scheduling=True)
    sched.add_request(req("p5", [2, 3], priority=5))
    sched.add_request(req("p1", [2, 4], priority=1))
    with pytest.raises(QueueFullError):
        sched.add_request(req("p1b", [2, 5], priority=1))  # not strictly better than the worst
    sched.add_request(req("p9", [2, 6], priority=9))  # evicts p1
    assert [r.rid for r in sched.waiting] == ["p5", "p9"]
    done = run_to_end(sched)
    assert done["p1"].finished_reason.kind is FinishKind.ABORT
    assert "higher priority" in done["p1"].finished_reason.message
    assert done["p5"].finished_reason.kind is not FinishKind.ABORT


def test_priority_rules_at_admission() -> None:
    strict, _ = make(abort_on_priority_when_disabled=True)
    with pytest.raises(ValueError, match="priority"):
        strict.add_request(req("x", [2, 3], priority=3))
    lenient, _ = make()
    lenient.add_request(req("x", [2, 3], priority=3))
    enabled, _ = make(enable_priority_scheduling=True)
    r = req("y", [2, 3])
    enabled.add_request(r)
    assert r.priority == 0
    run_to_end(lenient)
    run_to_end(enabled)


def test_no_preemption_for_a_request_its_own_cached_prefix_still_keeps_out() -> None:
    """The shortfall that sizes preemption counts the newcomer's cached prefix as it will be once locked:
    no longer evictable. Counted as evictable, a victim was preempted and the newcomer still refused."""
    sched, _ = make(slots=200, enable_priority_scheduling=True, priority_scheduling_preemption_threshold=10)
    shared = prompt_of(1, 50)
    sched.add_request(req("cached", shared, max_new=1, ignore_eos=True))
    run_to_end(sched)  # its 50 tokens stay in the tree, unlocked
    victim = req("victim", prompt_of(2, 10), max_new=20, priority=0, ignore_eos=True)
    busy = req("busy", prompt_of(3, 20), max_new=200, priority=95, ignore_eos=True)  # within the threshold
    sched.add_request(victim)
    sched.add_request(busy)
    for _ in range(3):
        sched.step()
    urgent = req("urgent", shared + prompt_of(4, 10), max_new=10, priority=100, ignore_eos=True)
    sched.add_request(urgent)
    sched.step()
    assert urgent in sched.running or (sched.num_preemptions == 0 and victim in sched.running)
    done = run_to_end(sched)
    assert done["urgent"].output_ids == reference_output(urgent.input_ids, 10, VOCAB)
    assert done["victim"].output_ids == reference_output(victim.input_ids, 20, VOCAB)


def test_no_preemption_for_a_row_a_request_cannot_use_this_round() -> None:
    """A newcomer over this round's prefill budget (behind another admitted one) is refused whatever is
    preempted: no victim is taken for its row, and it is admitted on a later round."""
    sched, _ = make(rows=2, enable_priority_scheduling=True, max_prefill_tokens=64)
    low = req("low", prompt_of(20, 5), max_new=40, priority=0, ignore_eos=True)
    sched.add_request(low)
    sched.step()
    small = req("small", prompt_of(21, 10), max_new=2, priority=50, ignore_eos=True)
    big = req("big", prompt_of(22, 60), max_new=2, priority=50, ignore_eos=True)
    sched.add_request(small)
    sched.add_request(big)
    sched.step()
    assert small in sched.running and low in sched.running and sched.num_preemptions == 0
    done = run_to_end(sched)
    assert done["big"].output_ids == reference_output(big.input_ids, 2, VOCAB)
    assert done["low"].output_ids == reference_output(low.input_ids, 40, VOCAB)
