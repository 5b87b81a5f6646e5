"""Stop strings (issue 16 item 6): bounded in count and length with a clear error, and matched in
one pass over the newest characters with the same result as checking each string on its own."""

from __future__ import annotations

import random

import pytest

from sgl_lite.runtime.managers.stop_checker import StopStrings, stop_match_start
from sgl_lite.runtime.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams, sampling_params_from_dict


def test_too_many_stop_strings_are_refused():
    with pytest.raises(ValueError, match=f"stop has {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}"):
        sampling_params_from_dict({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]})
    sampling_params_from_dict({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)]})


def test_a_too_long_stop_string_is_refused():
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRING_CHARS}"):
        SamplingParams(stop="x" * (MAX_STOP_STRING_CHARS + 1)).validate()
    SamplingParams(stop="x" * MAX_STOP_STRING_CHARS).validate()


def test_one_pass_matching_agrees_with_checking_each_string():
    rng = random.Random(0)
    alphabet = "ab c\n"
    for _ in range(3000):
        stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))})
        before = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        text = before + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
        starts = {s: stop_match_start(text, before, s) for s in stops}
        found = {s: i for s, i in starts.items() if i >= 0}
        matched = StopStrings(stops).first_ending_in(text, len(before))
        if not found:
            assert matched is None
        else:
            assert matched in found and found[matched] == min(found.values()), (stops, before, text)
