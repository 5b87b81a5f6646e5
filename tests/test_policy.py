"""Queue orders of every policy on constructed queues, including the seed's DFS-weight example."""

from __future__ import annotations

import torch

from sgl_lite.runtime.managers.policy import SchedulePolicy, prefix_match_key
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.radix_cache import RadixCache
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.testing.req_factory import make_req


def tree_with(*keys: list[int]) -> RadixCache:
    tree = RadixCache(None, None)
    for key in keys:
        tree.insert(key, torch.arange(1, len(key) + 1))
    return tree


def ordered(policy: SchedulePolicy, waiting: list[Req]) -> list[str]:
    queue = list(waiting)
    policy.order(queue)
    return [r.rid for r in queue]


def test_fcfs_orders_by_arrival() -> None:
    reqs = [make_req(f"r{i}", [i + 2, 3], arrival_time=t) for i, t in enumerate([5.0, 1.0, 3.0, 2.0, 4.0])]
    policy = SchedulePolicy(ServerArgs(schedule_policy="fcfs"), tree_with())
    assert ordered(policy, reqs) == ["r1", "r3", "r2", "r4", "r0"]


def test_lof_orders_by_max_new_tokens_then_arrival() -> None:
    reqs = [make_req("a", [2, 3], 1.0, max_new_tokens=5), make_req("b", [2, 3], 2.0, max_new_tokens=50),
            make_req("c", [2, 3], 3.0, max_new_tokens=5), make_req("d", [2, 3], 0.5, max_new_tokens=20)]
    policy = SchedulePolicy(ServerArgs(schedule_policy="lof"), tree_with())
    assert ordered(policy, reqs) == ["b", "d", "a", "c"]


def test_random_is_a_seeded_permutation() -> None:
    reqs = [make_req(f"r{i}", [i + 2, 3], float(i)) for i in range(30)]
    first = ordered(SchedulePolicy(ServerArgs(schedule_policy="random", random_seed=7), tree_with()), reqs)
    again = ordered(SchedulePolicy(ServerArgs(schedule_policy="random", random_seed=7), tree_with()), reqs)
    assert sorted(first) == sorted(r.rid for r in reqs)
    assert first == again
    assert first != [r.rid for r in reqs]


def test_lpm_orders_by_cached_prefix_length() -> None:
    common = list(range(100, 140))
    tree = tree_with(common + [7, 8, 9, 10], common[:20], [50, 51, 52])
    reqs = [
        make_req("none", [60, 61, 62, 63], 1.0),
        make_req("short", [50, 51, 52, 99, 98], 2.0),  # 3 cached
        make_req("long", common + [7, 8, 9, 10, 11], 3.0),  # 44 cached
        make_req("mid", common[:30] + [1, 2], 4.0),  # 30 cached
        make_req("mid2", common[:30] + [3, 4], 5.0),  # 30 cached, later arrival
    ]
    policy = SchedulePolicy(ServerArgs(schedule_policy="lpm"), tree)
    assert ordered(policy, reqs) == ["long", "mid", "mid2", "short", "none"]


def test_lpm_falls_back_to_fcfs_above_threshold() -> None:
    tree = tree_with([9] * 20)
    cold = [make_req(f"cold{i}", [i + 30, 1, 2], float(i)) for i in range(3)]
    hot = make_req("hot", [9] * 20 + [1], 10.0)
    policy = SchedulePolicy(ServerArgs(schedule_policy="lpm", lpm_fallback_threshold=4), tree)
    assert policy.active_policy(4) == "lpm" and policy.active_policy(5) == "fcfs"
    assert ordered(policy, cold + [hot]) == ["hot", "cold0", "cold1", "cold2"]  # 4 waiting: still LPM
    extra = make_req("cold3", [77, 1, 2], 11.0)
    assert ordered(policy, cold + [hot, extra]) == ["cold0", "cold1", "cold2", "hot", "cold3"]  # 5: FCFS


def test_dfs_weight_seed_example() -> None:
    # The seed's tree: Root -> A -> {C, D}; Root -> B -> E -> {F, G}. Segments are multi-token runs.
    a, b, c, d, e, f, g = [10, 11], [20, 21], [12, 13], [14, 15], [22, 23], [24, 25], [26, 27]
    tree = tree_with(a + c, a + d, b, b + e + f, b + e + g)
    # Waiting requests whose cached prefix ends at C (4), D (2), F (2), G (2); each adds one new token.
    spec = [("C", a + c, 4), ("D", a + d, 2), ("F", b + e + f, 2), ("G", b + e + g, 2)]
    reqs, t = [], 0.0
    # Interleave arrivals so that no order but DFS-weight's produces the expected one.
    for round_ in range(4):
        for name, path, count in reversed(spec):
            if round_ < count:
                reqs.append(make_req(f"{name}-{round_}", path + [90 + round_], t))
                t += 1.0
    policy = SchedulePolicy(ServerArgs(schedule_policy="dfs-weight"), tree)
    expected = ["C-0", "C-1", "C-2", "C-3", "D-0", "D-1", "F-0", "F-1", "G-0", "G-1"]
    assert ordered(policy, reqs) == expected
    assert [r.rid for r in sorted(reqs, key=lambda r: r.arrival_time)] != expected


def test_dfs_weight_heavier_branch_first_and_fallback() -> None:
    tree = tree_with([1, 2, 3], [5, 6, 7])
    light = [make_req("x0", [1, 2, 3, 40], 0.0)]
    heavy = [make_req(f"y{i}", [5, 6, 7, 41 + i], 1.0 + i) for i in range(2)]
    policy = SchedulePolicy(ServerArgs(schedule_policy="dfs-weight", lpm_fallback_threshold=3), tree)
    assert ordered(policy, light + heavy) == ["y0", "y1", "x0"]
    late = make_req("z", [8, 8], 9.0)
    assert ordered(policy, light + heavy + [late]) == ["x0", "y0", "y1", "z"]  # 4 > 3: FCFS


def test_in_batch_prefix_dedup_deprioritizes_a_sharing_request() -> None:
    shared = list(range(200, 240))  # 40 tokens, nothing cached
    reqs = [make_req("first", shared + [1], 0.0), make_req("twin", shared + [2], 1.0),
            make_req("other", [5, 6, 7], 2.0)]
    policy = SchedulePolicy(ServerArgs(schedule_policy="lpm"), tree_with())
    assert ordered(policy, reqs) == ["first", "other", "twin"]
    # Sharing fewer tokens than the deprioritize threshold: no change.
    policy = SchedulePolicy(ServerArgs(schedule_policy="lpm", in_batch_prefix_caching_deprioritize_threshold=41), tree_with())
    assert ordered(policy, reqs) == ["first", "twin", "other"]
    # A cached prefix longer than the check threshold: the check does not apply.
    policy = SchedulePolicy(ServerArgs(schedule_policy="lpm", in_batch_prefix_caching_check_threshold=4), tree_with(shared[:10]))
    assert ordered(policy, reqs) == ["first", "twin", "other"]


def test_priority_first_then_arrival_both_directions() -> None:
    reqs = [make_req("a", [2], 1.0, priority=1, max_new_tokens=8), make_req("b", [2], 2.0, priority=5, max_new_tokens=8),
            make_req("c", [2], 3.0, priority=1, max_new_tokens=8), make_req("d", [2], 0.5, priority=None, max_new_tokens=8)]
    high = SchedulePolicy(ServerArgs(enable_priority_scheduling=True), tree_with())
    assert ordered(high, reqs) == ["b", "a", "c", "d"]  # larger first; None counts as 0
    low = SchedulePolicy(ServerArgs(enable_priority_scheduling=True, schedule_low_priority_values_first=True), tree_with())
    assert ordered(low, reqs) == ["d", "a", "c", "b"]
    lof = SchedulePolicy(ServerArgs(schedule_policy="lof", enable_priority_scheduling=True), tree_with())
    reqs[2].sampling_params = SamplingParams(max_new_tokens=99)
    assert ordered(lof, reqs) == ["b", "c", "a", "d"]  # priority, then the policy's order


def test_prefix_match_key_keeps_logprob_positions_computable() -> None:
    req = make_req("r", list(range(2, 22)), 0.0)
    assert prefix_match_key(req) == list(range(2, 21))  # at least one token is computed
    req.return_logprob, req.logprob_start_len = True, 5
    assert len(prefix_match_key(req)) == 4  # logits at position 4 score token 5
    req.logprob_start_len = 0
    assert prefix_match_key(req) == []
    req.logprob_start_len = -1
    assert len(prefix_match_key(req)) == 19


def test_cache_aware_policy_without_cache_is_fcfs() -> None:
    policy = SchedulePolicy(ServerArgs(schedule_policy="lpm", disable_radix_cache=True), RadixCache(None, None, disable=True))
    assert policy.policy == "fcfs"
