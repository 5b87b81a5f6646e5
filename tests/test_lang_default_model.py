"""A few DSL programs on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import pytest

import sgl_lite as sgl

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def runtime():
    rt = sgl.Runtime(log_level="warning")
    yield rt
    rt.shutdown()


def test_chat_uses_smollm2_template_and_reuses_cache(runtime):
    @sgl.function
    def chat(s, questions):
        for i, question in enumerate(questions):
            s += sgl.user(question)
            s += sgl.assistant(sgl.gen(f"a{i}", max_tokens=4))

    sgl.flush_cache(runtime)
    state = chat.run(["What is the capital of France?", "And of Italy?"], temperature=0, backend=runtime)
    assert state.error() is None, state.error()
    # SmolLM2's template inserts its default system message when a chat starts without one.
    assert state.text().startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    metas = [state.get_meta_info(f"a{i}") for i in range(2)]
    for prev, cur in zip(metas, metas[1:]):
        # The previous prompt and (part of) the previous answer come from the prefix cache.
        assert cur["cached_tokens"] > prev["prompt_tokens"]


def test_select_picks_the_obvious_answer(runtime):
    @sgl.function
    def capital(s):
        s += "Q: What is the capital of France?\nA: The capital of France is"
        s += sgl.select("city", choices=[" Paris", " a banana", " the ocean"])

    state = capital.run(backend=runtime)
    assert state.error() is None, state.error()
    assert state["city"] == " Paris"
