"""The agent demo's tools and action grammar (pure parts; the agent itself runs in test_lang_runtime.py)."""

from __future__ import annotations

import re

import pytest

from sgl_lite.demo_agent import ACTION_PATTERN, action_regex, calculator, lookup


def test_calculator_is_arithmetic_only():
    assert calculator("330 * 1000") == "330000"
    assert calculator("(68 / 11.8)") == f"{68 / 11.8:.6g}"
    assert calculator("-2 ** 3") == "-8"
    assert calculator("__import__('os')").startswith("error")
    assert calculator("1 / 0").startswith("error")
    assert calculator("9 ** 999").startswith("error")


def test_lookup_table():
    assert lookup(" Height of the Eiffel Tower ") == "330 meters"
    assert lookup("nope").startswith("unknown key; known keys: ")


@pytest.mark.parametrize("turn,allowed", [(0, {"calculator", "lookup"}), (1, {"calculator", "lookup", "finish"}),
                                          (3, {"finish"})])
def test_action_regex_per_turn(turn, allowed):
    pattern = action_regex(turn, 4)
    for tool in ("calculator", "lookup", "finish"):
        assert bool(re.fullmatch(pattern, f"{tool}[330 * 10]")) == (tool in allowed)
    assert not re.fullmatch(pattern, "lookup[a]b]")
    assert ACTION_PATTERN.fullmatch("lookup[height of the eiffel tower").groups() == \
        ("lookup", "height of the eiffel tower")
