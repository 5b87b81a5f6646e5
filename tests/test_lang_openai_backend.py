"""The DSL's last SGLang gaps against a live runtime (tiny random model): join(mode="concate_and_append"),
sgl.global_config, and sgl.OpenAI running the same @function programs through the HTTP front,
checked against the ZeroMQ RuntimeEndpoint on the same runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

import sgl_lite as sgl
from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.runtime.client import RuntimeClient

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path) -> Iterator[tuple[Any, str]]:
    runtime = sgl.Runtime(model_path=str(tiny_llama_dir), dtype="float32", log_level="warning")
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), served_model_name="tiny"))
    try:
        yield runtime, http.url + "/v1"
    finally:
        http.stop()
        runtime.shutdown()


@sgl.function
def facts(s: Any, mode: str) -> None:
    s += "Here are some facts about foxes. " * 2
    forks = s.fork(2)
    forks += lambda i: f"Fact {i + 1}:" + sgl.gen("fact", max_tokens=4)
    forks.join(mode=mode)
    s += " Summary:" + sgl.gen("summary", max_tokens=3)


def test_concate_and_append_appends_the_branches_text(servers: tuple[Any, str]) -> None:
    runtime, _ = servers
    gathered = facts.run(mode="gather_variable", temperature=0, backend=runtime)
    appended = facts.run(mode="concate_and_append", temperature=0, backend=runtime)
    assert appended.error() is None, appended.error()
    shared = "Here are some facts about foxes. " * 2
    branches = "".join(f"Fact {i + 1}:" + fact for i, fact in enumerate(gathered["fact"]))
    assert appended.text() == shared + branches + " Summary:" + appended["summary"]
    # The summary was generated after the branches' text (not after the shared text alone).
    assert appended["summary"] == runtime.endpoint.generate(
        shared + branches + " Summary:", _greedy(3))[0]


def _greedy(max_tokens: int) -> Any:
    from sgl_lite.lang.ir import SglSamplingParams

    return SglSamplingParams(max_new_tokens=max_tokens, temperature=0)


def test_global_config_holds_the_default_backend(servers: tuple[Any, str]) -> None:
    runtime, _ = servers
    sgl.set_default_backend(runtime)
    try:
        assert sgl.global_config.default_backend is runtime
    finally:
        sgl.set_default_backend(None)
    assert sgl.global_config.default_backend is None


@sgl.function
def qa(s: Any) -> None:
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=6))
    s += sgl.user("Is that right?")
    s += sgl.assistant(sgl.select("verdict", choices=["yes", "no", "maybe not"]))


def test_openai_backend_runs_the_same_program_as_the_runtime_endpoint(servers: tuple[Any, str]) -> None:
    runtime, base_url = servers
    backend = sgl.OpenAI("tiny", base_url=base_url, api_key="unused",
                         chat_template=runtime.endpoint.get_chat_template())
    over_http = qa.run(temperature=0, backend=backend)
    over_zmq = qa.run(temperature=0, backend=runtime)
    assert over_http.error() is None, over_http.error()
    assert over_http["answer"] == over_zmq["answer"]
    assert over_http.text() == over_zmq.text()
    # select scored by the logprobs the server returned (echo), the same decision as the runtime's.
    assert over_http["verdict"] == over_zmq["verdict"]
    assert "fallback" not in over_http.get_meta_info("verdict")
    streamed = qa.run(temperature=0, backend=backend, stream=True)
    assert "".join(streamed.text_iter("answer")) == over_zmq["answer"]
