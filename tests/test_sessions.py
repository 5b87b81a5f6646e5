"""SessionStore and its sessions' request trees (http/sglang_api/sessions.py), without a runtime: what prompt
each continuation makes, the bounds (sessions, tokens, idle time) and the errors, with a fake clock."""

from __future__ import annotations

import pytest

from sgl_lite.http.errors import HttpError
from sgl_lite.http.sglang_api.sessions import Continuation, Session, SessionStore

BOS = 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _turn(session: Session, name: str, input_ids: list[int], output_ids: list[int], max_new_tokens: int = 8,
          **want: object) -> list[int]:
    """Run one request of `session` to its end with `output_ids`; its whole prompt."""
    node, prompt, _ = session.begin(name, Continuation(**want), input_ids, max_new_tokens, BOS)  # type: ignore[arg-type]
    session.finish(node, output_ids, 0.0)
    return prompt


def _error(fn, *args: object, **kwargs: object) -> HttpError:
    with pytest.raises(HttpError) as info:
        fn(*args, **kwargs)
    return info.value


def test_a_chain_of_turns_prompts_with_every_earlier_token_and_holds_each_once() -> None:
    store = SessionStore()
    session = store.get(store.open(1000))
    assert _turn(session, "a", [BOS, 10, 11], [20, 21]) == [BOS, 10, 11]
    # An appended turn's BOS is dropped, as SGLang does; the earlier prompt and output come first.
    assert _turn(session, "b", [BOS, 12], [22], rid="a") == [BOS, 10, 11, 20, 21, 12]
    assert _turn(session, "c", [13, 14], [23, 24], rid="b") == [BOS, 10, 11, 20, 21, 12, 22, 13, 14]
    assert session.held == 5 + 2 + 4  # each request's own input and output, not its whole prompt


@pytest.mark.parametrize(("want", "expected"), [
    ({"offset": 2}, [BOS, 10, 99]),  # the first 2 tokens of the prompt + output
    ({"offset": -1}, [BOS, 10, 11, 20, 99]),  # all but the last one
    ({"offset": 0}, [BOS, 10, 11, 20, 21, 99]),  # 0 keeps them all (SGLang's `if offset` reading)
    ({"drop_previous_output": True}, [BOS, 10, 11, 99]),
    ({"drop_previous_output": True, "offset": -1}, [BOS, 10, 99]),
    ({"offset": 5}, [BOS, 10, 11, 20, 21, 99]),
    ({"offset": -5}, [99]),
])
def test_offsets_and_drop_previous_output_cut_the_continued_tokens(want: dict, expected: list[int]) -> None:
    store = SessionStore()
    session = store.get(store.open(1000))
    _turn(session, "a", [BOS, 10, 11], [20, 21])
    assert _turn(session, "b", [99], [], rid="a", **want) == expected


@pytest.mark.parametrize("offset", [6, -6, 100])
def test_an_offset_past_the_continued_tokens_is_a_400_naming_it(offset: int) -> None:
    store = SessionStore()
    session = store.get(store.open(1000))
    _turn(session, "a", [BOS, 10, 11], [20, 21])
    error = _error(session.begin, "b", Continuation("a", offset), [99], 8, BOS)
    assert error.status == 400 and error.param == "session_params.offset" and "[-5, 5]" in error.message
    assert set(session.requests) == {"a"}  # nothing registered


def test_branches_and_replace() -> None:
    store = SessionStore()
    session = store.get(store.open(1000))
    _turn(session, "root", [5], [6])
    assert _turn(session, "left", [7], [8], rid="root") == [5, 6, 7]
    assert _turn(session, "right", [9], [10], rid="root") == [5, 6, 9]  # both branch from root
    _turn(session, "left2", [11], [], rid="left")
    # Replacing root's continuation drops its branches (left, left2, right); root stays.
    assert _turn(session, "new", [12], [13], rid="root", replace=True) == [5, 6, 12]
    assert set(session.requests) == {"root", "new"}
    error = _error(session.begin, "x", Continuation("left"), [1], 8, BOS)
    assert error.status == 404 and error.param == "session_params.rid"
    # Replace naming no request starts the session over.
    assert _turn(session, "fresh", [3], [4], replace=True) == [3]
    assert set(session.requests) == {"fresh"} and session.held == 2


def test_a_running_request_cannot_be_continued_and_a_failed_one_leaves_no_trace() -> None:
    store = SessionStore()
    session = store.get(store.open(1000))
    running, _, _ = session.begin("a", Continuation(), [1, 2], 8, BOS)
    error = _error(session.begin, "b", Continuation("a"), [3], 8, BOS)
    assert error.status == 400 and "has not finished" in error.message
    session.forget(running, 0.0)
    assert session.requests == {} and running.done.is_set()
    assert _error(session.begin, "b", Continuation("a"), [3], 8, BOS).status == 404


def test_a_rid_names_one_request_of_a_session() -> None:
    store = SessionStore()
    session = store.get(store.open(1000))
    _turn(session, "a", [1], [2])
    error = _error(session.begin, "a", Continuation("a"), [3], 8, BOS)
    assert error.status == 400 and error.param == "rid"


def test_capacity_counts_running_requests_input_and_max_new_tokens() -> None:
    store = SessionStore()
    session = store.get(store.open(20))
    node, _, _ = session.begin("a", Continuation(), list(range(10)), 8, BOS)
    assert session.held == 18  # reserved while it runs
    error = _error(session.begin, "b", Continuation(), [1, 2, 3], 1, BOS)
    assert error.status == 400 and error.param == "session_params" and "capacity_of_str_len" in error.message
    session.finish(node, [7, 7], 0.0)
    assert session.held == 12  # its actual output now
    _turn(session, "b", [1], [2], max_new_tokens=7, rid="a")
    # Replacing frees the branches it drops before the new request is counted.
    _turn(session, "c", [1] * 5, [], max_new_tokens=3, rid="a", replace=True)
    assert set(session.requests) == {"a", "c"}


def test_a_streaming_session_appends_to_its_latest_request_only() -> None:
    store = SessionStore()
    session = store.get(store.open(1000, streaming=True))
    assert _turn(session, "a", [1, 2], [3]) == [1, 2]
    assert _turn(session, "b", [4], [5], rid="ignored") == [1, 2, 3, 4]
    running, prompt, _ = session.begin("c", Continuation(), [6], 8, BOS)
    assert prompt == [1, 2, 3, 4, 5, 6]
    assert "one request at a time" in _error(session.begin, "d", Continuation(), [7], 8, BOS).message
    session.forget(running, 0.0)  # a failed turn: the next one appends to b again
    assert _turn(session, "d", [7], []) == [1, 2, 3, 4, 5, 7]
    for name in ("replace", "drop_previous_output", "offset"):
        value = 1 if name == "offset" else True
        assert _error(session.begin, "e", Continuation(**{name: value}), [8], 8, BOS).param == f"session_params.{name}"


def test_store_bounds_open_close_and_idle_expiry() -> None:
    clock = Clock()
    ended: list[str] = []
    store = SessionStore(max_sessions=2, max_capacity=100, idle_timeout_s=10.0, clock=clock, on_end=ended.append)
    assert _error(store.open, 101).param == "capacity_of_str_len"
    assert _error(store.open, 0).param == "capacity_of_str_len"
    assert _error(store.open, 10, timeout_s=11.0).param == "timeout"
    first = store.open(10, "mine")
    assert first == "mine" and _error(store.open, 10, "mine").status == 400
    busy = store.get(store.open(10, timeout_s=5.0))
    error = _error(store.open, 10)
    assert error.status == 503 and error.code == "too_many_sessions"
    running, _, _ = busy.begin("r", Continuation(), [1], 1, BOS)
    clock.now = 10.5  # past both timeouts: "mine" is idle and expires; the busy one runs a request
    assert len(store) == 1 and _error(store.get, "mine").status == 404
    assert ended == ["mine"]  # told once, so that the runtime unpins its prefix
    busy.finish(running, [2], clock.now)
    clock.now += 5.5
    assert len(store) == 0 and ended == ["mine", busy.id]
    store.open(10, "again")
    store.close("again")
    assert _error(store.close, "again").status == 404 and _error(store.get, "again").code == "session_not_found"
    assert ended == ["mine", busy.id, "again"]
    with pytest.raises(ValueError, match="at most"):
        SessionStore(idle_timeout_s=1e9)
