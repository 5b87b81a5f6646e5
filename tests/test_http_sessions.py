"""SGLang's session API over HTTP (/open_session, /close_session, session_params on /generate) against a live
runtime (tiny random model): a session's turn gives what the whole prompt sent at once gives (greedy), its
earlier tokens come from the prefix cache, and every misuse is a 400 or 404 naming the field. Expected
outputs come from the server itself, sent the concatenated ids without a session."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from test_http import API_KEY, Live, live  # noqa: F401  (live: the fixture)
from waiting import wait_until

from sgl_lite.runtime.client import RuntimeRequestError
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
FIRST, SECOND, THIRD = [5, 17, 40, 41, 42], [60, 61, 62], [70, 71]


def _open(live: Live, **body: Any) -> str:
    response = live.post("/open_session", {"capacity_of_str_len": 1000, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _generate(live: Live, body: dict[str, Any]) -> dict[str, Any]:
    response = live.post("/generate", {"sampling_params": GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _turn(live: Live, session: str, input_ids: list[int], **params: Any) -> dict[str, Any]:
    return _generate(live, {"input_ids": input_ids, "session_params": {"id": session, **params}})


def _error(live: Live, body: dict[str, Any], path: str = "/generate") -> tuple[int, dict[str, Any]]:
    response = live.post(path, body)
    return response.status_code, response.json()["error"]


def test_a_two_turn_session_gives_the_tokens_of_the_concatenated_prompt(live: Live) -> None:
    session = _open(live)
    first = _turn(live, session, FIRST)
    second = _turn(live, session, SECOND, rid=first["meta_info"]["id"])
    whole = FIRST + first["output_ids"] + SECOND
    expected = _generate(live, {"input_ids": whole})
    assert second["output_ids"] == expected["output_ids"] and second["text"] == expected["text"]
    assert second["meta_info"]["prompt_tokens"] == len(whole)
    # The first turn's prompt and output were cached when it finished: only SECOND is new.
    assert second["meta_info"]["cached_tokens"] >= len(FIRST)
    third = _turn(live, session, THIRD, rid=second["meta_info"]["id"])
    assert third["output_ids"] == _generate(live, {"input_ids": whole + second["output_ids"] + THIRD})["output_ids"]
    assert live.post("/close_session", {"session_id": session}).status_code == 200
    assert_idle_without_leaks(live.client)


@pytest.mark.parametrize("params", [{"offset": 3}, {"offset": -2}, {"drop_previous_output": True},
                                    {"drop_previous_output": True, "offset": -1}])
def test_offsets_and_drop_previous_output(live: Live, params: dict[str, Any]) -> None:
    session = _open(live)
    first = _turn(live, session, FIRST)
    base = FIRST if params.get("drop_previous_output") else FIRST + first["output_ids"]
    offset = params.get("offset")
    kept = base if not offset else base[:offset]
    turn = _turn(live, session, SECOND, rid=first["meta_info"]["id"], **params)
    assert turn["meta_info"]["prompt_tokens"] == len(kept + SECOND)
    assert turn["output_ids"] == _generate(live, {"input_ids": kept + SECOND})["output_ids"]


def test_branches_replace_and_errors(live: Live) -> None:
    session = _open(live)
    root = _turn(live, session, FIRST)["meta_info"]["id"]
    left = _turn(live, session, SECOND, rid=root)["meta_info"]["id"]
    right = _turn(live, session, THIRD, rid=root, replace=True)  # drops `left`
    assert right["meta_info"]["prompt_tokens"] == len(FIRST) + GREEDY["max_new_tokens"] + len(THIRD)
    status, error = _error(live, {"input_ids": [1], "session_params": {"id": session, "rid": left}})
    assert status == 404 and error["param"] == "session_params.rid" and left in error["message"]
    status, error = _error(live, {"input_ids": [1], "session_params": {"id": session, "rid": root, "offset": 99}})
    assert status == 400 and error["param"] == "session_params.offset"
    status, error = _error(live, {"input_ids": [1], "rid": root, "session_params": {"id": session}})
    assert status == 400 and error["param"] == "rid"  # a rid names one request of a session
    status, error = _error(live, {"input_ids": [1], "sampling_params": {"n": 2}, "session_params": {"id": session}})
    assert status == 400 and error["param"] == "session_params"
    status, error = _error(live, {"input_ids": [1], "session_params": {"rid": root}})
    assert status == 400 and "session_params.id" in error["message"]
    status, error = _error(live, {"input_ids": [1], "session_params": {"id": session, "offset": "2"}})
    assert status == 400 and "offset" in error["message"]
    status, error = _error(live, {"capacity_of_str_len": 10, "session_id": session}, "/open_session")
    assert status == 400 and error["param"] == "session_id"
    assert live.post("/close_session", {"session_id": session}).status_code == 200
    status, error = _error(live, {"input_ids": [1], "session_params": {"id": session, "rid": root}})
    assert status == 404 and error["code"] == "session_not_found"
    assert _error(live, {"session_id": session}, "/close_session")[0] == 404
    assert_idle_without_leaks(live.client)


def test_capacity_and_a_failed_turn_leaves_no_trace(live: Live) -> None:
    session = _open(live, capacity_of_str_len=40, session_id="small")
    assert session == "small"
    first = _turn(live, session, FIRST)["meta_info"]["id"]
    status, error = _error(live, {"input_ids": list(range(30)), "sampling_params": GREEDY,
                                  "session_params": {"id": session, "rid": first}})
    assert status == 400 and "capacity_of_str_len" in error["message"]
    # A turn the runtime refuses (a token id outside the vocabulary) is not kept: its rid stays unknown.
    status, _ = _error(live, {"input_ids": [10**6], "rid": "bad", "session_params": {"id": session, "rid": first}})
    assert status == 400
    status, error = _error(live, {"input_ids": [1], "session_params": {"id": session, "rid": "bad"}})
    assert status == 404 and error["param"] == "session_params.rid"
    assert _turn(live, session, SECOND, rid=first)["meta_info"]["prompt_tokens"] == len(FIRST) + 6 + len(SECOND)
    assert_idle_without_leaks(live.client)


def test_a_streamed_turn_and_a_streaming_session(live: Live) -> None:
    session = _open(live, streaming=True)
    body = {"input_ids": FIRST, "sampling_params": GREEDY, "stream": True, "session_params": {"id": session}}
    with httpx2.stream("POST", live.http.url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=60) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    first = json.loads(events[-2])
    assert events[-1] == "[DONE]" and first["meta_info"]["finish_reason"] is not None
    # A streaming session appends to its latest request without naming it.
    second = _turn(live, session, SECOND)
    whole = FIRST + first["output_ids"] + SECOND
    assert second["output_ids"] == _generate(live, {"input_ids": whole})["output_ids"]
    third = _turn(live, session, THIRD)
    assert third["meta_info"]["prompt_tokens"] == len(whole) + len(second["output_ids"]) + len(THIRD)
    status, error = _error(live, {"input_ids": [1], "session_params": {"id": session, "replace": True}})
    assert status == 400 and error["param"] == "session_params.replace"


def test_text_turns_are_tokenized_as_the_runtime_tokenizes_them(live: Live) -> None:
    session = _open(live)
    first = _generate(live, {"text": "The capital of France", "session_params": {"id": session}})
    second = _generate(live, {"text": " is a city", "session_params": {"id": session, "rid": first["meta_info"]["id"]}})
    ids = live.tokenizer("The capital of France")["input_ids"] + first["output_ids"]
    ids += live.tokenizer(" is a city", add_special_tokens=False)["input_ids"]
    assert second["output_ids"] == _generate(live, {"input_ids": ids})["output_ids"]


def test_replace_aborts_the_running_request_and_continues_its_output_so_far(live: Live) -> None:
    session = _open(live, capacity_of_str_len=4096)
    body = {"input_ids": FIRST, "rid": "long", "stream": True, "session_params": {"id": session},
            "sampling_params": {**GREEDY, "max_new_tokens": 1500}}
    with httpx2.stream("POST", live.http.url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs
        status, error = _error(live, {"input_ids": SECOND, "session_params": {"id": session, "rid": "long"}})
        assert status == 400 and "has not finished" in error["message"]
        replacing = _turn(live, session, SECOND, rid="long", replace=True)
        events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < 1500
    assert replacing["meta_info"]["prompt_tokens"] == len(FIRST) + len(last["output_ids"]) + len(SECOND)
    assert_idle_without_leaks(live.client)


def test_the_python_client_opens_continues_and_closes_a_session(live: Live) -> None:
    runtime = live.runtime  # sgl.Runtime: SGLang Engine's open_session / generate(session_params) / close_session

    def turn(input_ids: list[int], **params: Any) -> dict[str, Any]:
        return json.loads(runtime.generate(input_ids=input_ids, sampling_params=GREEDY, session_params=params))

    pins = runtime.client.server_info()["num_session_pins"]
    session = runtime.open_session(1000, session_id="py-client", timeout=60.0)
    assert session == "py-client"
    first = json.loads(runtime.generate(input_ids=FIRST, sampling_params=GREEDY, rid="py-1", session_params={"id": session}))
    assert first["meta_info"]["id"] == "py-1"
    assert runtime.client.server_info()["num_session_pins"] == pins + 1  # its KV is kept last while it is open
    second = turn(SECOND, id=session, rid="py-1")
    whole = FIRST + first["output_ids"] + SECOND
    assert second["output_ids"] == _generate(live, {"input_ids": whole})["output_ids"]
    assert second["meta_info"]["cached_tokens"] >= len(FIRST)
    cut = turn(THIRD, id=session, rid="py-1", drop_previous_output=True, offset=-1, replace=True)
    assert cut["meta_info"]["prompt_tokens"] == len(FIRST) - 1 + len(THIRD)
    with pytest.raises(RuntimeRequestError, match="session_params.rid"):
        turn([1], id=session, rid=second["meta_info"]["id"])  # replaced by the turn before
    with pytest.raises(ValueError, match="unknown key"):
        runtime.generate(input_ids=[1], session_params={"id": session, "ofset": 1})
    with pytest.raises(ValueError, match="needs an id"):
        runtime.generate(input_ids=[1], session_params={"rid": "py-1"})
    with pytest.raises(ValueError, match="prompt or input_ids"):
        runtime.generate("text", input_ids=[1])
    runtime.close_session(session)
    with pytest.raises(RuntimeRequestError, match="404"):
        turn([1], id=session, rid="py-1")
    with pytest.raises(RuntimeRequestError, match="404"):
        runtime.close_session(session)
    with pytest.raises(RuntimeRequestError, match="capacity_of_str_len"):
        runtime.open_session(0)
    assert_idle_without_leaks(runtime.client)
    # closed: unpinned (the front sends that without waiting for it)
    wait_until(lambda: runtime.client.server_info()["num_session_pins"] == pins, "the closed session's prefix to be "
               "unpinned", 10, poll_s=0.05)
