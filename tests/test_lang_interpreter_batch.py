"""The interpreter's run_batch, streaming and bind, against the in-process bigram backend of test_lang_interpreter.py."""

from __future__ import annotations

import asyncio

import pytest
from test_lang_interpreter import backend  # noqa: F401 - a fixture

import sgl_lite as sgl


def test_run_batch_order_errors_and_progress_bar(backend, capfd):
    @sgl.function
    def prog(s, i):
        if i == 2:
            raise RuntimeError(f"program {i} failed")
        s += f"item {i}:" + sgl.gen("x", max_tokens=2)

    states = prog.run_batch([{"i": i} for i in range(5)], progress_bar=True, num_threads=3, backend=backend)
    assert "5/5" in capfd.readouterr().err
    for i, state in enumerate(states):
        if i == 2:
            assert "program 2 failed" in str(state.error())
        else:
            assert state.error() is None
            assert state.text().startswith(f"item {i}:")


def test_run_batch_shared_prefix_hint(backend):
    long_context = "This is a long shared context that every program in the batch starts with. " * 2

    @sgl.function
    def prog(s, q):
        s += long_context + q + sgl.gen("x", max_tokens=2)

    prog.run_batch([("a",), ("b",)], backend=backend)
    assert backend.requests[0] == ("prefill", long_context)
    backend.requests.clear()

    @sgl.function
    def short(s, q):
        s += "short " + q + sgl.gen("x", max_tokens=2)

    short.run_batch([("a",), ("b",)], backend=backend)
    assert all(kind != "prefill" for kind, _ in backend.requests)


def test_run_batch_traces_the_body_once_with_placeholders(backend):
    """The prefix hint runs the body once (as SGLang's tracer does), not once more per item with its real
    arguments: side effects before the first gen (a tool call, a counter, taking from a queue) happen once
    per item, plus that one trace."""
    long_context = "This is a long shared context that every program in the batch starts with. " * 2
    calls: list = []

    @sgl.function
    def prog(s, q):
        calls.append(q)
        s += long_context
        s += f"Question: {q}" + sgl.gen("x", max_tokens=2)

    states = prog.run_batch([("a",), ("b",), ("c",)], backend=backend)
    assert all(state.error() is None for state in states)
    real = [q for q in calls if isinstance(q, str)]
    assert sorted(real) == ["a", "b", "c"] and len(calls) == 4
    assert backend.requests[0] == ("prefill", long_context)


def test_streaming_joins_to_final_text(backend):
    @sgl.function
    def prog(s):
        s += "stream:" + sgl.gen("x", max_tokens=8)

    state = prog.run(stream=True, backend=backend)
    pieces = list(state.text_iter("x"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["x"]
    state2 = prog.run(stream=True, backend=backend)
    assert "".join(state2.text_iter()) == state2.text()

    async def collect():
        st = prog.run(stream=True, backend=backend)
        return [p async for p in st.text_async_iter("x")], st

    pieces, st = asyncio.run(collect())
    assert "".join(pieces) == st["x"]


def test_bind_and_positional_batch(backend):
    @sgl.function
    def prog(s, a, b="B"):
        s += a + b

    assert prog.bind(b="Z").run(a="A", backend=backend).text() == "AZ"
    states = prog.run_batch([("1",), ("2", "3")], backend=backend)
    assert [st.text() for st in states] == ["1B", "23"]
    with pytest.raises(TypeError):
        prog.run_batch([()], backend=backend)


def test_tracing_the_batch_prefix_reports_no_failure(backend, caplog):
    """An ordinary program whose argument is appended (`s += context + q`) traces its prefix without a
    warning: the trace ends at the argument, and no program failed."""
    long_context = "This is a long shared context that every program in the batch starts with. " * 2

    @sgl.function
    def prog(s, q):
        s += long_context + q
        s += sgl.gen("x", max_tokens=2)

    with caplog.at_level("DEBUG", logger="sgl_lite"):
        states = prog.run_batch([("a",), ("b",)], backend=backend)
    assert all(state.error() is None for state in states)
    assert backend.requests[0] == ("prefill", long_context)
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == []
