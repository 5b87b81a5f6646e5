"""Streaming detokenization: no broken characters, and the deltas add up to the final text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_lite.runtime.server.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, stop_hold_back_chars
from sgl_lite.testing.tiny_model import build_tokenizer

TEXT = "Unicode: café naïve 東京 Привет — “quotes” 🙂🙂 and 42 plain words."


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _stream(detok, ids):
    deltas = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    return [d for d in deltas if d]


def test_multibyte_characters_split_across_tokens_are_held_back(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The byte-level tokenizer really does split some characters over several tokens:
    partial = [tokenizer.decode(ids[:i]) for i in range(1, len(ids))]
    assert any(p.endswith(REPLACEMENT_CHAR) for p in partial)
    detok = IncrementalDetokenizer(_decoder(tokenizer))
    deltas = _stream(detok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    final = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) + detok.finish(final) == final == TEXT


def test_hold_back_keeps_stop_string_prefixes_unsent(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    stop = "lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(_decoder(tokenizer), stop_hold_back_chars([stop, "x"]))
    final = text[: text.index(stop)]  # what the scheduler returns with the stop string trimmed
    streamed = ""
    for i in range(len(ids)):
        decoded = tokenizer.decode(ids[: i + 1])
        if stop in decoded:  # the scheduler finishes on the token that completes the stop string
            break
        streamed += detok.update(ids[: i + 1])
        assert final.startswith(streamed), streamed
    assert streamed + detok.finish(final) == final


def test_invalid_bytes_do_not_stall_the_stream(tokenizer):
    lone = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == REPLACEMENT_CHAR
                and tokenizer.decode([i, i]) == REPLACEMENT_CHAR * 2)  # a byte that never starts a character
    ascii_ids = tokenizer.encode("ok then", add_special_tokens=False)
    ids = [lone] * 3 + ascii_ids + [lone] * 3
    detok = IncrementalDetokenizer(_decoder(tokenizer))
    streamed = "".join(_stream(detok, ids))
    assert streamed.endswith("ok then")  # not held back behind the invalid bytes around it
    final = tokenizer.decode(ids, skip_special_tokens=True)
    assert streamed + detok.finish(final) == final


def test_new_ids_reports_each_id_once(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(_decoder(tokenizer))
    reported = []
    for i in range(0, len(ids), 3):
        reported += detok.new_ids(ids[: i + 3])
    assert reported == ids


def test_stop_hold_back_chars():
    assert stop_hold_back_chars([]) == 0
    assert stop_hold_back_chars(["ab", "abcd"]) == 3


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_token_sequence_streams_consistently(tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))
    detok = IncrementalDetokenizer(_decoder(tokenizer))
    deltas = _stream(detok, ids)
    final = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) + detok.finish(final) == final
