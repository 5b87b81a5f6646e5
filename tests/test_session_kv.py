"""An open session's KV is the last the radix cache evicts (mem_cache/session_pins.py), against a live runtime with a
small KV pool (tiny random model), driven through `sgl.Runtime`'s session API and its HTTP front: one-off requests
fill the pool, the session's next turn still finds its prefix while an equivalent conversation without a session
lost its; once the session closes its prefix goes like any other; a pin never keeps a request from running."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from waiting import wait_until

from sgl_lite.lang.launcher import Runtime
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(300)

POOL = 512
NEW_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SESSION, CONVERSATION = list(range(10, 110)), list(range(110, 210))  # distinct first tokens: separate branches
FILL_PROMPT, FILLS = 120, 5  # five one-off prompts hold more than the whole pool


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir: Path) -> Iterator[Runtime]:
    with Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, dtype="float32", max_total_tokens=POOL) as rt:
        yield rt


def _generate(runtime: Runtime, input_ids: list[int], **options: Any) -> dict[str, Any]:
    return json.loads(runtime.generate(input_ids=input_ids, sampling_params=GREEDY, **options))


def _fill(runtime: Runtime, round_: int) -> None:
    """One-off requests whose prompts hold more tokens than the pool: every unpinned older prefix is evicted."""
    for i in range(FILLS):
        first = 220 + FILLS * round_ + i
        _generate(runtime, [first] + [(first + k) % 384 for k in range(1, FILL_PROMPT)])


def _pins(runtime: Runtime, expected: int) -> None:
    """Wait until the runtime holds `expected` session pins (an unpin is sent without waiting for it)."""
    wait_until(lambda: runtime.client.server_info()["num_session_pins"] == expected,
               lambda: f"{expected} session pins, not {runtime.client.server_info()['num_session_pins']}", 10, poll_s=0.05)


def test_an_open_sessions_prefix_outlives_one_off_requests_and_goes_once_closed(runtime: Runtime) -> None:
    session = runtime.open_session(4096)
    first = _generate(runtime, SESSION, session_params={"id": session})  # the oldest prefix: LRU's first victim
    conversation = _generate(runtime, CONVERSATION)
    _pins(runtime, 1)
    _fill(runtime, 0)
    second = _generate(runtime, [300, 301], session_params={"id": session, "rid": first["meta_info"]["id"]})
    # The first turn's prompt and output (all but its last token, whose KV was never computed) were kept.
    assert second["meta_info"]["cached_tokens"] == len(SESSION) + NEW_TOKENS - 1
    again = _generate(runtime, CONVERSATION + conversation["output_ids"] + [300, 301])
    assert again["meta_info"]["cached_tokens"] == 0  # the same conversation without a session was evicted
    runtime.close_session(session)
    _pins(runtime, 0)
    _fill(runtime, 1)
    whole = SESSION + first["output_ids"] + [300, 301] + second["output_ids"]
    assert _generate(runtime, whole)["meta_info"]["cached_tokens"] == 0  # closed: evicted like any other
    assert_idle_without_leaks(runtime.client)


def test_a_pinned_prefix_gives_way_when_a_request_needs_the_whole_pool(runtime: Runtime) -> None:
    session = runtime.open_session(4096)
    first = _generate(runtime, SESSION, session_params={"id": session})
    _pins(runtime, 1)
    big = _generate(runtime, [383] + [1 + k % 380 for k in range(POOL - NEW_TOKENS - 2)])
    assert big["meta_info"]["finish_reason"]["type"] == "length"  # it ran, though only the pin's tokens were left
    # The pin lost its tokens with them; the session itself goes on.
    second = _generate(runtime, [300], session_params={"id": session, "rid": first["meta_info"]["id"]})
    assert second["meta_info"]["prompt_tokens"] == len(SESSION) + NEW_TOKENS + 1
    runtime.close_session(session)
    _pins(runtime, 0)
    assert_idle_without_leaks(runtime.client)
