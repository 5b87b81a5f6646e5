"""The runtime server end to end: a real `sgl-lite serve` subprocess with a tiny model on loopback.

One server process is shared by the module; the api-key, size-limit, ipc and shutdown tests run the
same server code in a thread over the reference Engine's core. Every test that sends something leaves
the server idle with every KV slot free or evictable. A dying runtime (SIGKILLed or stopped) is
tested in test_client_liveness.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import stat
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq
from waiting import wait_until

from sgl_lite.lang.launcher import Runtime, _child_env
from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError, use_api_key
from sgl_lite.runtime.server.event_loop import RuntimeServer
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(240)

SERVER_ARGS = dict(dtype="float32", device="cpu", context_length=512, max_total_tokens=8192, log_level="warning")
PROMPTS = ["The quick brown fox", "What is the capital of France?", "def add(a, b):", "Unicode: café 東京 🙂",
           "Thought: I should call a tool.", "A journey of a thousand miles", "Berlin is the capital of", "{\"name\": "]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}
LONG = {"max_new_tokens": 480, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def runtime(tiny_model):
    rt = Runtime(model_path=tiny_model, startup_timeout=180, client_timeout=60, **SERVER_ARGS)
    yield rt
    rt.shutdown()
    assert rt.process.returncode == 0, rt.stderr_tail()  # SIGTERM is a clean shutdown


@pytest.fixture(scope="module")
def client(runtime) -> RuntimeClient:
    return runtime.client


@pytest.fixture(scope="module")
def engine(tiny_model):
    from sgl_lite.runtime.server.engine import Engine

    with Engine(model_path=tiny_model, **SERVER_ARGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, dict]:
    """Greedy answers of an in-process Engine on the same weights and flags, one prompt at a time."""
    return {p: engine.generate(p, dict(GREEDY)) for p in PROMPTS}


def server_stats(client: RuntimeClient) -> dict:
    return client.server_info()


def wait_until_running(client: RuntimeClient, wait_s: float = 30.0) -> None:
    """Until the runtime is generating (mid-request), without relying on when text gets streamed."""
    wait_until(lambda: server_stats(client)["num_running"], "a request to start running", wait_s)


class RawPeer:
    """A bare DEALER socket (with `api_key`, passing the handshake with it), to send bytes no well-behaved
    client would."""

    def __init__(self, address: str, api_key: str | None = None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        use_api_key(self.socket, api_key)
        self.socket.connect(address)

    def send(self, payload: bytes) -> None:
        self.socket.send(payload)

    def ask(self, payload: bytes, timeout: float = 10.0) -> protocol.Reply | None:
        self.send(payload)
        deadline = time.monotonic() + timeout
        while self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            reply = protocol.decode_reply(self.socket.recv())
            if not (isinstance(reply, protocol.InfoReply) and reply.rid == ""):  # skip keepalives
                return reply
        return None

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def raw(runtime):
    peer = RawPeer(runtime.address)
    yield peer
    peer.close()


def check_still_serving(client: RuntimeClient, prompt: str = "The quick brown fox") -> None:
    out = client.generate(prompt, sampling_params={"max_new_tokens": 4, "temperature": 0.0})
    assert out.meta_info["completion_tokens"] == len(out.output_ids) > 0
    assert_idle_without_leaks(client)


# ---------------------------------------------------------------------------- correct traffic


def test_concurrent_clients_get_their_own_answers(runtime, reference):
    results: dict[tuple[int, str], protocol.Finished] = {}
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            with RuntimeClient(runtime.address, timeout=60) as own_client:
                for prompt in PROMPTS[worker::4]:
                    results[(worker, prompt)] = own_client.generate(prompt, sampling_params=GREEDY)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == len(PROMPTS)
    for (_, prompt), out in results.items():
        assert out.output_ids == reference[prompt]["output_ids"], prompt
        assert out.text == reference[prompt]["text"], prompt


def test_shared_client_from_many_threads(client, reference):
    results: dict[str, protocol.Finished] = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, client.generate(p, sampling_params=GREEDY)))
               for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {p: r.text for p, r in results.items()} == {p: reference[p]["text"] for p in PROMPTS}
    assert_idle_without_leaks(client)


def test_async_clients_get_their_own_answers(client, reference):
    async def main() -> tuple[list[protocol.Finished], str]:
        answers = await asyncio.gather(*(client.async_generate(p, sampling_params=GREEDY) for p in PROMPTS[:4]))
        streamed = "".join([c.text async for c in client.async_generate_stream(PROMPTS[4], sampling_params=GREEDY)])
        return answers, streamed

    answers, streamed = asyncio.run(main())
    assert [a.text for a in answers] == [reference[p]["text"] for p in PROMPTS[:4]]
    assert streamed == reference[PROMPTS[4]]["text"]


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_stream_chunks_concatenate_to_the_final_text(client, reference, prompt):
    chunks = list(client.generate_stream(prompt, sampling_params=GREEDY))
    assert "".join(c.text for c in chunks) == reference[prompt]["text"]
    assert [t for c in chunks for t in c.output_ids] == reference[prompt]["output_ids"]
    # Equality above already rules out a premature U+FFFD (it would not be in the final text there).
    final_meta = chunks[-1].meta_info
    assert final_meta["finish_reason"] is not None
    assert final_meta["completion_tokens"] == len(reference[prompt]["output_ids"])


def test_stream_with_a_stop_string_matches_the_trimmed_text(client, reference):
    # A two-character stop string from the middle of some greedy output (real characters only).
    prompt, start = next((p, i) for p in PROMPTS for i in range(3, len(reference[p]["text"]) - 2)
                         if "\ufffd" not in reference[p]["text"][i : i + 2] and reference[p]["text"][i : i + 2].strip())
    full = reference[prompt]["text"]
    stop = full[start : start + 2]
    params = {**GREEDY, "stop": [stop]}
    expected = client.generate(prompt, sampling_params=params).text
    assert expected == full[: full.find(stop)]
    assert "".join(c.text for c in client.generate_stream(prompt, sampling_params=params)) == expected


def test_abort_mid_stream_ends_it_with_the_output_so_far_and_frees_its_slots(client, engine):
    stream = client.generate_stream("The quick brown fox", sampling_params=LONG, rid="to-abort")
    chunks = [next(stream)]  # it is generating
    client.abort("to-abort")
    chunks += list(stream)
    ids = [t for c in chunks for t in c.output_ids]
    assert chunks[-1].meta_info["finish_reason"] == {"type": "abort", "message": "aborted by the client"}
    assert chunks[-1].meta_info["completion_tokens"] == len(ids) < LONG["max_new_tokens"]
    # what it had generated: a greedy run of that length from scratch gives the same tokens and text
    again = engine.generate("The quick brown fox", {**LONG, "max_new_tokens": len(ids)})
    assert ids == again["output_ids"] and "".join(c.text for c in chunks) == again["text"]
    assert_idle_without_leaks(client)


def test_killed_client_process_leaves_no_slot_behind(runtime, client):
    script = (
        "import sys\n"
        "from sgl_lite.runtime.client import RuntimeClient\n"
        "c = RuntimeClient(sys.argv[1], timeout=60)\n"
        f"stream = c.generate_stream('What is the capital of France?', sampling_params={LONG!r})\n"
        "print('sent', flush=True)\n"
        "list(stream)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, runtime.address], stdout=subprocess.PIPE, text=True,
                            env=_child_env())
    try:
        assert proc.stdout.readline().strip() == "sent"
        wait_until_running(client)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_idle_without_leaks(client)


@pytest.mark.parametrize("stream", [False, True])
def test_cli_generate_prints_the_answer(runtime, reference, stream):
    prompt = PROMPTS[1]
    out = subprocess.run([sys.executable, "-m", "sgl_lite.cli", "generate", "--address", runtime.address,
                          "--prompt", prompt, "--max-new-tokens", "16", *(["--stream"] if stream else [])],
                         capture_output=True, text=True, env=_child_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == reference[prompt]["text"] + "\n"


def test_server_info_and_flush(client):
    info = client.server_info()
    assert info["slots_total"] > 0 and "context_length" in info
    assert client.flush_cache() is True
    assert client.health()
    assert_idle_without_leaks(client)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "payload, rid, named",
    [
        (random.Random(0).randbytes(64), "", "undecodable"),
        (msgspec.msgpack.encode({"type": "LaunchMissiles", "rid": "u1"}), "u1", "unknown message type 'LaunchMissiles'"),
        (msgspec.msgpack.encode({"type": "GenerateReq", "rid": "w1", "text": "hi", "sampling_params": {"temperature": "hot"}}),
         "w1", "$.sampling_params.temperature"),
        (msgspec.msgpack.encode({"type": "GenerateReq", "rid": 42, "text": "hi"}), "", "$.rid"),
        (msgspec.msgpack.encode({"type": "GenerateReq", "text": "hi"}), "", "missing required field `rid`"),
        (msgspec.msgpack.encode({"type": "GenerateReq", "rid": "u2", "text": "hi", "colour": "red"}), "u2", "colour"),
    ],
    ids=["random-bytes", "unknown-type", "wrong-field-type", "wrong-rid-type", "missing-field", "unknown-field"],
)
def test_malformed_messages_get_an_error_naming_the_problem(raw, client, payload, rid, named):
    reply = raw.ask(payload)
    assert isinstance(reply, protocol.ErrorReply), reply
    assert reply.rid == rid and reply.code == "bad_request"
    assert named in reply.message
    check_still_serving(client)


@pytest.mark.parametrize(
    "params, named",
    [({"temperature": -1.0}, "temperature"), ({"top_p": 5.0}, "top_p"), ({"max_new_tokens": -3}, "max_new_tokens"),
     ({"max_new_tokens": 10**9}, "max_new_tokens"), ({"top_k": 0}, "top_k"), ({"regex": "("}, "regex")],
)
def test_out_of_range_sampling_values_are_refused(client, params, named):
    with pytest.raises(RuntimeRequestError, match=named) as info:
        client.generate("The quick brown fox", sampling_params=params)
    assert info.value.code == "bad_request"
    check_still_serving(client)


def test_prompt_longer_than_the_context_is_refused(client):
    with pytest.raises(RuntimeRequestError, match="context") as info:
        client.generate("The quick brown fox jumps over the lazy dog. " * 200, sampling_params={"max_new_tokens": 4})
    assert info.value.code == "bad_request"
    check_still_serving(client)


def test_text_and_input_ids_missing_is_refused(client):
    with pytest.raises(RuntimeRequestError, match="text"):
        client.generate(sampling_params={"max_new_tokens": 4})
    check_still_serving(client)


def test_abort_of_an_unknown_request_id_names_it(client):
    with pytest.raises(RuntimeRequestError, match="no-such-request"):
        client.abort("no-such-request")
    check_still_serving(client)


def test_duplicate_in_flight_rid_is_refused(raw, client):
    request = protocol.GenerateReq("dup", text="The quick brown fox", sampling_params=protocol.SamplingParams(**LONG))
    raw.send(protocol.encode(request))
    wait_until_running(client)
    reply = raw.ask(protocol.encode(request))
    assert isinstance(reply, protocol.ErrorReply) and "already in flight" in reply.message
    ended = raw.ask(protocol.encode(protocol.AbortReq("dup")))  # the first one ends aborted
    assert isinstance(ended, protocol.Finished) and ended.rid == "dup"
    assert ended.meta_info["finish_reason"]["type"] == "abort"
    check_still_serving(client)


# ---------------------------------------------------------------------------- api key, size limit, ipc
# These run a RuntimeServer in a thread of this process over the reference Engine's RuntimeCore: the
# same server code, without another model load. One server per test; never two on one core at once.


@pytest.fixture
def secure_server(engine, tmp_path):
    args = ServerArgs(model_path=engine.args.model_path, host=f"ipc://{tmp_path / 'runtime.sock'}",
                      api_key="s3cret", max_message_bytes=4096)
    server = RuntimeServer(engine.core, args)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.request_shutdown()
    thread.join(30)
    assert not thread.is_alive()
    engine.core.scheduler.check_invariant()


def test_ipc_socket_is_private_and_removed_at_shutdown(secure_server):
    path = secure_server.address[len("ipc://") :]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with RuntimeClient(secure_server.address, api_key="s3cret", timeout=30) as c:
        check_still_serving(c)
    secure_server.request_shutdown()
    # ZeroMQ itself leaves the file behind
    wait_until(lambda: not os.path.exists(path), "the ipc socket file to go with its server", poll_s=0.05)


@pytest.mark.parametrize("key", [None, "wrong", "s3cre"])
def test_wrong_api_key_is_unauthorized(secure_server, key):
    with RuntimeClient(secure_server.address, api_key=key, timeout=30) as bad_client:
        with pytest.raises(RuntimeRequestError) as info:
            bad_client.generate("The quick brown fox", sampling_params={"max_new_tokens": 4})
        assert info.value.code == "unauthorized"
        assert "api_key" in info.value.message
        assert not bad_client.health(timeout=5)
    with RuntimeClient(secure_server.address, api_key="s3cret", timeout=30) as c:
        check_still_serving(c)


def test_messages_over_the_size_limit(secure_server):
    peer = RawPeer(secure_server.address, "s3cret")
    try:
        over = protocol.GenerateReq("big", text="x" * 6000)
        reply = peer.ask(protocol.encode(over))
        assert isinstance(reply, protocol.ErrorReply) and reply.rid == "big"
        assert "--max-message-bytes 4096" in reply.message
        # Far over the limit: ZeroMQ drops it (and the connection) before anyone can read a rid.
        huge = protocol.GenerateReq("huge", text="x" * 100_000)
        assert peer.ask(protocol.encode(huge), timeout=2) is None
        # The same peer reconnects and is served again.
        reply = peer.ask(protocol.encode(protocol.HealthReq("after")))
        assert isinstance(reply, protocol.InfoReply) and reply.rid == "after"
    finally:
        peer.close()
    with RuntimeClient(secure_server.address, api_key="s3cret", timeout=30) as c:
        check_still_serving(c)


def test_shutdown_aborts_in_flight_requests_with_a_reason(secure_server):
    with RuntimeClient(secure_server.address, api_key="s3cret", timeout=30) as c:
        stream = c.generate_stream("The quick brown fox", sampling_params=LONG)
        wait_until_running(c)
        secure_server.request_shutdown()  # what the SIGINT/SIGTERM handlers of `sgl-lite serve` call
        with pytest.raises(RuntimeRequestError, match="shutting down") as info:
            for _ in stream:
                pass
        assert info.value.code == "aborted"


# ---------------------------------------------------------------------------- start-up


def test_launcher_reports_a_server_that_cannot_start(tmp_path):
    from sgl_lite.lang.launcher import RuntimeLaunchError

    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeLaunchError, match="no-such-model"):
        Runtime(model_path=str(missing), startup_timeout=120, **SERVER_ARGS)
