"""The shared idle-and-no-leak check flags every way an idle runtime can be off, and waits for settling."""

from __future__ import annotations

from typing import Any

import pytest

from sgl_lite.testing.kv_accounting import BUSY_KEYS, accounting_problems, assert_idle_without_leaks

IDLE = {"num_running": 0, "num_waiting": 0, "num_chunked": 0, "num_grammar_pending": 0,
        "slots_total": 100, "slots_free": 60, "slots_evictable": 40, "slots_protected": 0}


class Snapshots:
    """server_info() answers from a list, then repeats the last one."""

    def __init__(self, *infos: dict[str, Any]) -> None:
        self.infos = list(infos)

    def server_info(self) -> dict[str, Any]:
        return self.infos.pop(0) if len(self.infos) > 1 else self.infos[0]


def test_an_idle_balanced_runtime_has_no_problems() -> None:
    assert accounting_problems(IDLE) == []


@pytest.mark.parametrize("key", BUSY_KEYS)
def test_each_busy_count_is_a_problem(key: str) -> None:
    info = {**IDLE, key: 1}
    if key == "slots_protected":
        info["slots_evictable"] -= 1  # still balanced: only the lock is wrong
    assert accounting_problems(info) == [f"{key} = 1, expected 0"]


def test_slots_that_nobody_accounts_for_are_a_problem() -> None:
    problems = accounting_problems({**IDLE, "slots_free": 59})
    assert problems == ["free 59 + evictable 40 + protected 0 != total 100"]


def test_waits_for_the_runtime_to_settle_and_names_what_stayed_wrong() -> None:
    assert assert_idle_without_leaks(Snapshots({**IDLE, "num_running": 2}, IDLE), timeout=5) == IDLE
    with pytest.raises(AssertionError, match="num_chunked = 1"):
        assert_idle_without_leaks(Snapshots({**IDLE, "num_chunked": 1}), timeout=0.2)
