"""Programs whose backend fails: a failed gen, fork branch, streamed gen or variable scope fails its program
(never hangs a reader), and a refused prefix hint fails nothing (test_lang_interpreter.py's bigram backend)."""

from __future__ import annotations

import threading
import time

import pytest
from test_lang_interpreter import BigramBackend

import sgl_lite as sgl
from sgl_lite.lang.executor import ProgramError


class FailingGenBackend(BigramBackend):
    """Every gen fails, a streamed one after two pieces (a runtime timeout, say); prefix hints are refused."""

    def generate(self, text, params):
        raise RuntimeError("the runtime timed out")

    def generate_stream(self, text, params):
        yield "par", {}
        yield "tial", {}
        raise RuntimeError("the runtime timed out")

    def cache_prefix(self, text):
        raise RuntimeError("max_tokens must be at least 1")  # vLLM's answer to a prefill-only hint


def test_a_failed_fork_branch_fails_the_parent_without_hanging_its_readers():
    class BranchFails(BigramBackend):
        def generate(self, text, params):
            if text.endswith("branch"):
                raise RuntimeError("branch gen failed")
            if text.endswith("trunk"):
                time.sleep(0.5)  # the trunk is still busy when the branches are joined
            return super().generate(text, params)

    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += "branch" + sgl.gen("b", max_tokens=2)
        s += "trunk" + sgl.gen("z1", max_tokens=2)
        s += sgl.gen("z2", max_tokens=2)
        forks.join()
        return s["z2"]  # was: waited forever for a gen skipped after the branch's error

    outcome: list = []

    def run() -> None:
        try:
            prog.run(backend=BranchFails())
        except Exception as e:  # noqa: BLE001 - what the reader of z2 got is the point
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the program hung"
    assert isinstance(outcome[0], ProgramError) and "branch gen failed" in str(outcome[0])


def test_a_streamed_gen_that_fails_has_no_value():
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("x", max_tokens=5)

    state = prog.run(backend=FailingGenBackend(), stream=True)
    for _ in state.text_iter():
        pass
    assert "timed out" in str(state.error())
    with pytest.raises(ProgramError):
        state["x"]  # not the partial "partial" it streamed


def test_a_var_scope_cut_short_by_an_error_has_no_value():
    @sgl.function
    def prog(s):
        with s.var_scope("v"):
            s += "Q:" + sgl.gen("x", max_tokens=5)

    state = prog.run(backend=FailingGenBackend())
    with pytest.raises(ProgramError):
        state["v"]  # was the scope's start position, an int


def test_a_refused_prefix_hint_does_not_fail_the_program():
    class HintRefused(BigramBackend):
        def cache_prefix(self, text):
            raise RuntimeError("max_tokens must be at least 1")

    @sgl.function
    def prog(s):
        s += "shared prefix "
        forks = s.fork(2)  # hints the prefix first
        forks += sgl.gen("b", max_tokens=2)
        forks.join()

    state = prog.run(backend=HintRefused())
    assert state.error() is None and len(state["b"]) == 2
