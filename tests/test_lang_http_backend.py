"""The DSL over SGLang's HTTP protocol (lang/backend/http_runtime.py), against `sgl-lite serve` and
through sglang-router in front of a `--dp-size 2` cluster.

One server, two endpoints: `RuntimeEndpoint(url)` speaks ZeroMQ (the server names its endpoint),
`RuntimeEndpoint(url, transport="http")` speaks HTTP to the same runtime; the same programs must give
the same results both ways. Through the router (which names no ZeroMQ endpoint, so the endpoint
chooses HTTP by itself) programs run as they do on one replica, with an API key sent as a Bearer
header, and programs that share a prefix are routed to the replica that caches it.
"""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests

import sgl_lite as sgl
from sgl_lite.lang.backend.model_files import served_model_facts, tokenizer_facts
from sgl_lite.lang.backend.runtime_endpoint import RuntimeEndpoint
from sgl_lite.runtime.client import RuntimeRequestError, RuntimeUnavailableError
from sgl_lite.runtime.free_port import free_port

pytestmark = pytest.mark.timeout(240)

PROMPT = "The quick brown fox"
SHARED = "You are a careful assistant that answers questions about animals plainly. " * 4
COMPARED_META = ("prompt_tokens", "completion_tokens", "finish_reason")


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir: Path) -> Iterator[Any]:
    rt = sgl.Runtime(model_path=str(tiny_llama_dir), dtype="float32", log_level="warning")
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def endpoints(runtime: Any) -> Iterator[dict[str, RuntimeEndpoint]]:
    both = {"zmq": RuntimeEndpoint(runtime.url), "http": RuntimeEndpoint(runtime.url, transport="http")}
    yield both
    for endpoint in both.values():
        endpoint.close()


def meta(info: dict[str, Any], with_cache: bool = True) -> dict[str, Any]:
    keys = COMPARED_META + (("cached_tokens",) if with_cache else ())
    return {key: info[key] for key in keys}


# ---------------------------------------------------------------- programs run both ways


@sgl.function
def two_turns(s):
    s += PROMPT + sgl.gen("first", max_tokens=8)
    s += "\nAnd then:" + sgl.gen("second", max_tokens=6, stop=["\n"])


@sgl.function
def constrained(s):
    s += "Number: " + sgl.gen_int("n", max_tokens=6) + "\n"
    s += "Flag: " + sgl.gen("b", dtype=bool, max_tokens=4) + "\n"
    s += "Pick: " + sgl.gen("r", regex=r"(yes|no)", max_tokens=4) + "\n"
    s += "Color: " + sgl.gen("j", json_schema=json.dumps({"enum": ["red", "green"]}), max_tokens=6)


@sgl.function
def forked(s):
    s += SHARED
    forks = s.fork(3)
    forks += lambda i: f"Fact {i}:" + sgl.gen("fact", max_tokens=4)
    forks.join()
    s += " Summary:" + sgl.gen("summary", max_tokens=3)


@sgl.function
def qa(s, animal):
    s += SHARED + "Q: What does a " + animal + " eat? A:" + sgl.gen("a", max_tokens=4)


def run_both(endpoints: dict[str, RuntimeEndpoint], run: Callable[[RuntimeEndpoint], Any]) -> dict[str, Any]:
    """`run` against each endpoint, each after a cache flush, so both start from the same cache (and
    each run's programs done before the next flush, which a runtime with requests in flight refuses)."""
    results = {}
    for name, endpoint in endpoints.items():
        assert endpoint.flush_cache() is True
        results[name] = run(endpoint)
        for state in results[name] if isinstance(results[name], list) else [results[name]]:
            state.sync()
    return results


def test_auto_speaks_zeromq_to_sgl_lite_and_http_when_asked(runtime, endpoints):
    assert endpoints["zmq"].transport == "zmq" and endpoints["zmq"].address == runtime.address
    assert endpoints["http"].transport == "http" and endpoints["http"].address == runtime.url
    # Over HTTP the chat template comes from the server's /get_server_info, as over ZeroMQ.
    assert endpoints["http"].get_chat_template() == endpoints["zmq"].get_chat_template()
    assert endpoints["http"].get_model_name() == endpoints["zmq"].get_model_name()
    assert "internal_states" in endpoints["http"].get_server_info()  # SGLang's /get_server_info shape


def test_gen_and_cached_tokens_are_the_same_over_http(endpoints):
    states = run_both(endpoints, lambda e: two_turns.run(backend=e, temperature=0))
    for state in states.values():
        assert state.error() is None, state.error()
    zmq, http = states["zmq"], states["http"]
    assert (http["first"], http["second"], http.text()) == (zmq["first"], zmq["second"], zmq.text())
    for name in ("first", "second"):
        assert meta(http.get_meta_info(name)) == meta(zmq.get_meta_info(name))
    # The second turn reuses the first turn's prompt from the cache, over HTTP too.
    assert http.get_meta_info("second")["cached_tokens"] >= http.get_meta_info("first")["prompt_tokens"]


def test_regex_and_json_constraints_are_the_same_over_http(endpoints):
    states = run_both(endpoints, lambda e: constrained.run(backend=e, temperature=0))
    zmq, http = states["zmq"], states["http"]
    assert http.error() is None and zmq.error() is None, (http.error(), zmq.error())
    for name in ("n", "b", "r", "j"):
        assert http[name] == zmq[name], name
    int(http["n"])
    assert http["b"] in ("True", "False") and http["r"] in ("yes", "no")
    assert json.loads(http["j"]) in ("red", "green")


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
@pytest.mark.parametrize("prefix,choices", [
    ("What is the capital of France? Answer:", [" Paris", " Berlin is", " the dog", " 42"]),
    ("Paris is the capital of Fr", ["ance.", "ench", "ogs"]),  # the tokenizer merges some choices with the prefix
])
def test_select_scores_are_the_same_over_http(endpoints, method, prefix, choices):
    @sgl.function
    def pick(s):
        s += prefix + sgl.select("pick", choices=choices, choices_method=method)

    states = run_both(endpoints, lambda e: pick.run(backend=e))
    zmq, http = states["zmq"], states["http"]
    assert http.error() is None, http.error()
    assert http["pick"] == zmq["pick"] and http.text() == zmq.text()
    zmq_meta, http_meta = zmq.get_meta_info("pick"), http.get_meta_info("pick")
    assert http_meta["normalized_prompt_logprobs"] == pytest.approx(zmq_meta["normalized_prompt_logprobs"], abs=1e-4)
    assert [len(e) for e in http_meta["input_token_logprobs"]] == [len(e) for e in zmq_meta["input_token_logprobs"]]


def test_fork_join_and_its_prefix_hint_over_http(endpoints):
    states = run_both(endpoints, lambda e: forked.run(backend=e, temperature=0))
    zmq, http = states["zmq"], states["http"]
    assert http.error() is None, http.error()
    assert http["fact"] == zmq["fact"] and http["summary"] == zmq["summary"]
    shared_tokens = endpoints["http"].prefill([sgl_prefill(SHARED)])[0]["prompt_tokens"]
    # The fork's prefix hint (a prefill-only /generate) put the shared text in the cache before the branches ran.
    for info in http.get_meta_info("fact"):
        assert info["cached_tokens"] >= shared_tokens - 1, info


def test_run_batch_is_the_same_over_http(endpoints):
    animals = ["fox", "cat", "dog", "cow", "owl"]
    batches = run_both(endpoints, lambda e: qa.run_batch([{"animal": a} for a in animals], backend=e,
                                                         temperature=0))
    shared_tokens = endpoints["http"].prefill([sgl_prefill(SHARED)])[0]["prompt_tokens"]
    for zmq, http in zip(batches["zmq"], batches["http"]):
        assert http.error() is None, http.error()
        assert http["a"] == zmq["a"] and http.text() == zmq.text()
        assert meta(http.get_meta_info("a"), with_cache=False) == meta(zmq.get_meta_info("a"), with_cache=False)
        assert http.get_meta_info("a")["cached_tokens"] >= shared_tokens - 1  # the batch's prefix hint


def test_streaming_is_the_same_over_http(endpoints):
    @sgl.function
    def story(s):
        s += PROMPT + sgl.gen("out", max_tokens=12)

    results = {}
    for name, endpoint in endpoints.items():
        state = story.run(backend=endpoint, stream=True, temperature=0)
        pieces = list(state.text_iter("out"))
        assert "".join(pieces) == state["out"]
        results[name] = (state["out"], meta(state.get_meta_info("out"), with_cache=False))
    assert results["http"] == results["zmq"]


def test_a_refused_request_fails_only_its_program_over_http(endpoints):
    @sgl.function
    def item(s, i):
        s += f"Item {i}:" + sgl.gen("x", max_tokens=2)
        if i == 1:
            s += sgl.gen("y", top_p=5.0)  # refused by the server, naming the field

    states = item.run_batch([{"i": i} for i in range(3)], backend=endpoints["http"], temperature=0)
    assert "top_p" in str(states[1].error())
    with pytest.raises(Exception, match="top_p"):
        states[1]["y"]
    assert states[0].error() is None and states[2].error() is None


def test_endpoint_arguments_are_checked_before_connecting():
    with pytest.raises(ValueError, match="transport"):
        RuntimeEndpoint("http://127.0.0.1:9", transport="grpc")
    with pytest.raises(ValueError, match="transport='http' needs"):
        RuntimeEndpoint("tcp://127.0.0.1:9", transport="http")
    with pytest.raises(ValueError, match="chat_template_name"):
        RuntimeEndpoint("http://127.0.0.1:9", chat_template_name="vicuna")


@contextlib.contextmanager
def http_only_gateway(target: str, zmq_address: str) -> Iterator[str]:
    """An HTTP gateway in front of `target` that passes HTTP only (no streaming needed here): the
    server_info it passes on names `zmq_address`, which is not the runtime's."""

    class Gateway(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            upstream = requests.get(target + self.path, timeout=30)
            body = upstream.content
            if self.path in ("/server_info", "/get_server_info"):
                body = json.dumps({**upstream.json(), "zmq_address": zmq_address}).encode()
            self.answer(upstream.status_code, body)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            upstream = requests.post(target + self.path, data=data, timeout=30,
                                     headers={"Content-Type": "application/json"})
            self.answer(upstream.status_code, upstream.content)

        def answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_a_named_zeromq_endpoint_that_cannot_be_reached_falls_back_to_http(runtime, endpoints):
    with http_only_gateway(runtime.url, f"tcp://127.0.0.1:{free_port()}") as url:
        endpoint = RuntimeEndpoint(url, timeout=5)
        try:
            assert endpoint.transport == "http" and endpoint.address == url
            state = two_turns.run(backend=endpoint, temperature=0)
            expected = two_turns.run(backend=endpoints["zmq"], temperature=0)
            assert state.error() is None, state.error()
            assert state.text() == expected.text()
        finally:
            endpoint.close()
        with pytest.raises(RuntimeUnavailableError, match="no sgl_lite runtime answers"):
            RuntimeEndpoint(url, timeout=5, transport="zmq")


def sgl_prefill(text: str) -> Any:
    from sgl_lite.lang.backend.base import PrefillRequest

    return PrefillRequest(text=text)


# ---------------------------------------------------------------- the chat template from the model's files


def test_tokenizer_facts_read_the_models_own_files(tiny_llama_dir, tmp_path):
    facts = tokenizer_facts(str(tiny_llama_dir))  # tokenizer_config.json + chat_template.jinja
    assert facts["chat_template"] == (tiny_llama_dir / "chat_template.jinja").read_text()
    assert facts["eos_token"] == json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())["eos_token"]
    # The older form: named templates inside tokenizer_config.json, special tokens as AddedToken dicts.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": "{{ x }}"}],
        "eos_token": {"content": "</s>", "special": True}, "bos_token": "<s>"}))
    assert tokenizer_facts(str(tmp_path)) == {"chat_template": "{{ x }}", "eos_token": "</s>", "bos_token": "<s>"}
    assert tokenizer_facts(str(tmp_path / "missing")) == {}
    assert tokenizer_facts("no-such-org/no-such-model") == {}  # not in the Hugging Face cache: nothing fetched


def test_a_server_reported_template_wins_over_the_files(tiny_llama_dir):
    server_info = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}", "eos_token": "<e>"}
    facts = served_model_facts(server_info, {"model_path": str(tiny_llama_dir)})
    assert facts["chat_template"] == server_info["chat_template"] and facts["eos_token"] == "<e>"
    # SGLang's server_info names a template (a name or a file), which is not its text: the files decide.
    facts = served_model_facts({"chat_template": "chatml"}, {"model_path": str(tiny_llama_dir)})
    assert facts["chat_template"] == (tiny_llama_dir / "chat_template.jinja").read_text()
    # An sgl_lite worker's model_info (what the router passes on) carries the template: no files needed.
    reported = {"model_path": "/not/on/this/machine", "chat_template": "{{ messages[0].content }}", "bos_token": "<b>"}
    facts = served_model_facts({}, reported)
    assert facts["chat_template"] == reported["chat_template"] and facts["bos_token"] == "<b>"


# ---------------------------------------------------------------- through sglang-router

ROUTER_KEY = "dsl-router-key-51c2"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[Any]:
    pytest.importorskip("sglang_router")
    from sgl_lite.cluster import Cluster, free_port
    from sgl_lite.runtime.server_args import ServerArgs

    args = ServerArgs(model_path=str(tiny_llama_dir), dtype="float32", log_level="warning", api_key=ROUTER_KEY)
    c = Cluster(args.replace(port=free_port()), dp=2, router_policy="cache_aware", startup_timeout=120)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def router_endpoints(cluster: Any) -> Iterator[dict[str, RuntimeEndpoint]]:
    """The router's URL (HTTP, chosen by itself) and one replica's (ZeroMQ), for comparisons."""
    both = {"router": RuntimeEndpoint(cluster.url, api_key=ROUTER_KEY),
            "replica": RuntimeEndpoint(cluster.worker_urls[0], api_key=ROUTER_KEY)}
    yield both
    for endpoint in both.values():
        endpoint.close()


def replica_prompt_tokens(cluster: Any) -> list[int]:
    headers = {"Authorization": f"Bearer {ROUTER_KEY}"}
    return [int(requests.get(url + "/server_info", headers=headers, timeout=30).json()["prompt_tokens_total"])
            for url in cluster.worker_urls]


def test_the_router_is_spoken_to_over_http_with_the_key(cluster, router_endpoints):
    router, replica = router_endpoints["router"], router_endpoints["replica"]
    assert router.transport == "http" and replica.transport == "zmq"
    # The template comes from a worker's /get_model_info, which the router passes on: the runtime's own.
    assert router.get_chat_template() == replica.get_chat_template()
    with pytest.raises(RuntimeRequestError) as refused:
        RuntimeEndpoint(cluster.url)  # no key: the router's /get_model_info passes the replica's 401 on
    assert refused.value.code == "unauthorized"
    with pytest.raises(RuntimeUnavailableError, match="names no ZeroMQ endpoint"):
        RuntimeEndpoint(cluster.url, api_key=ROUTER_KEY, transport="zmq")


def test_programs_through_the_router_match_a_replica(router_endpoints):
    router, replica = router_endpoints["router"], router_endpoints["replica"]
    for program in (two_turns, constrained, forked):
        via_router = program.run(backend=router, temperature=0)
        direct = program.run(backend=replica, temperature=0)
        assert via_router.error() is None, via_router.error()
        assert via_router.text() == direct.text(), program.func.__name__

    @sgl.function
    def pick(s):
        s += "What is the capital of France? Answer:" + sgl.select("city", choices=[" Paris", " Berlin", " 42"])

    assert pick.run(backend=router)["city"] == pick.run(backend=replica)["city"]
    streamed = two_turns.run(backend=router, stream=True, temperature=0)
    assert "".join(streamed.text_iter()) == two_turns.run(backend=replica, temperature=0).text()


def test_programs_sharing_a_prefix_land_on_one_replica(cluster, router_endpoints):
    router = router_endpoints["router"]
    assert router.flush_cache() is True  # through the router: every replica
    before = replica_prompt_tokens(cluster)
    animals = ["fox", "cat", "dog", "cow", "owl", "bee"]
    # One at a time, so the loads stay equal and cache-aware routing alone decides where each goes.
    states = qa.run_batch([{"animal": a} for a in animals], backend=router, temperature=0, num_threads=1)
    after = replica_prompt_tokens(cluster)
    metas = [state.get_meta_info("a") for state in states]
    assert all(state.error() is None for state in states)
    cached = sum(m["cached_tokens"] for m in metas)
    prompt = sum(m["prompt_tokens"] for m in metas)
    per_replica = [b - a for a, b in zip(before, after)]
    report = f"hit rate {cached}/{prompt} = {cached / prompt:.2f}; prompt tokens per replica {per_replica}"
    assert min(per_replica) == 0, report  # the prefix hint and every program went to one replica
    shared_tokens = router.prefill([sgl_prefill(SHARED)])[0]["prompt_tokens"]
    assert all(m["cached_tokens"] >= shared_tokens - 1 for m in metas), report
