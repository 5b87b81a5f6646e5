"""Hostile grammars (issue 16 item 2): caps checked at admission, conversion and compile off the
scheduler thread, more than one compile worker, cancellation on abort, no busy loop while a grammar
is pending, and a prompt exit on SIGTERM with a compile running.

A "slow schema" is an object nested SLOW_LEVELS levels deep: xgrammar's conversion of it takes many
seconds (super-linear in depth), so it stands for any expensive spec; the servers that take it run
with the caps raised.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from test_hostile_wire import SERVER_ARGS, ServerThread, still_serving
from waiting import wait_until

from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError
from sgl_lite.runtime.managers.validation import QueueFullError
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.grammar_backend import grammar_key
from sgl_lite.runtime.server import core as core_module
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(240)

SLOW_LEVELS = 260
RAISED_CAPS = dict(max_json_schema_depth=100_000, max_grammar_chars=10_000_000)


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def engine(tiny_model) -> Iterator[Engine]:
    with Engine(model_path=tiny_model, **SERVER_ARGS) as eng:
        yield eng


def raise_caps(engine: Engine, monkeypatch, **more: object) -> None:
    """The limits are the core's flags (the scheduler reads them), not the transport's."""
    for name, value in {**RAISED_CAPS, **more}.items():
        monkeypatch.setattr(engine.core.scheduler.args, name, value)


def compile_threads() -> int:
    return sum(t.name == "grammar-compile" for t in threading.enumerate())


def compiling_pids(engine: Engine) -> list[int]:
    """The worker processes running a compile now."""
    pool = engine.core.scheduler.validator._grammar_backend._pool
    with pool._cond:
        return [pid for _, runner in pool._running.values() if (pid := runner.pid) is not None]


def cpu_seconds(pid: int) -> float | None:
    """The CPU time a process has used (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone before the open (FileNotFoundError) or between open and read (ProcessLookupError)
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_gone(pid: int, seconds: float = 10.0) -> None:
    wait_until(lambda: cpu_seconds(pid) is None, f"worker {pid} to exit", seconds, poll_s=0.05)


# The runaway regex: 24 KB, under every size limit, and its compile runs for minutes.
RUNAWAY_REGEX = "(a|aa|aaa|aaaa)*" * 1500 + "b<i>"


# ---------------------------------------------------------------------------- caps at admission


@pytest.mark.parametrize("schema, named", [
    (nested_schema(100), "--max-json-schema-depth 64"),  # 300 JSON levels
    ({"enum": [f"value-number-{i}" for i in range(20_000)]}, "--max-grammar-chars 65536"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "only local references"),
])
def test_oversized_or_remote_schemas_are_refused_at_admission(engine, schema, named):
    for given in (schema, json.dumps(schema)):
        start = time.monotonic()
        with pytest.raises(ValueError, match="json_schema") as info:
            engine.generate("hi", {"max_new_tokens": 4, "json_schema": given})
        assert named in str(info.value)
        assert time.monotonic() - start < 2.0
    assert not engine.core.scheduler.has_work()


def test_a_schema_too_deep_for_the_json_parser_is_refused_by_depth(engine):
    text = '{"a":' * 10_000 + "1" + "}" * 10_000  # under the size cap, past Python's recursion limit
    with pytest.raises(ValueError, match="--max-json-schema-depth"):
        engine.generate("hi", {"max_new_tokens": 4, "json_schema": text})


def test_regex_and_ebnf_over_the_size_cap_are_refused(engine):
    with pytest.raises(ValueError, match="regex of 70000 characters exceeds --max-grammar-chars"):
        engine.generate("hi", {"max_new_tokens": 4, "regex": "a" * 70_000})
    with pytest.raises(ValueError, match="ebnf of .* exceeds --max-grammar-chars"):
        engine.generate("hi", {"max_new_tokens": 4, "ebnf": 'root ::= "' + "a" * 70_000 + '"'})


def structural_tag(schema: object) -> dict:
    """A structural tag (xgrammar's format, as the HTTP front builds for tools) holding `schema`."""
    return {"type": "structural_tag", "format": {"type": "tag", "begin": "<x>", "end": "</x>",
                                                 "content": {"type": "json_schema", "json_schema": schema}}}


@pytest.mark.parametrize("tag, named", [
    ('[' * 100_000, "--max-grammar-chars 65536"),
    ('[' * 10_000 + "]" * 10_000, "--max-json-schema-depth 64"),  # past Python's recursion limit
    (structural_tag(nested_schema(30)), "--max-json-schema-depth 64"),
    (structural_tag({"enum": [f"value-number-{i}" for i in range(20_000)]}), "--max-grammar-chars 65536"),
    (structural_tag({"$ref": "https://example.com/a.json"}), "only local references"),
])
def test_structural_tags_have_the_json_schema_caps(engine, tag, named):
    for given in (tag, json.dumps(tag)) if isinstance(tag, dict) else (tag,):
        with pytest.raises(ValueError, match="structural_tag") as info:
            engine.generate("hi", {"max_new_tokens": 4, "structural_tag": given})
        assert named in str(info.value)
    assert not engine.core.scheduler.has_work()


def test_a_hostile_structural_tag_with_a_long_prompt_costs_one_request(engine, tmp_path, monkeypatch):
    """A long text is tokenized off the loop and queued from there (here every text is: the threshold is
    lowered), where a structural tag that raised RecursionError once ended the server loop; and any other
    failure to queue a request there costs that request only."""
    monkeypatch.setattr(core_module, "INLINE_TOKENIZE_MAX_CHARS", 1)
    server = ServerThread(engine, f"ipc://{tmp_path / 'rt.sock'}")
    try:
        with RuntimeClient(server.address, timeout=60) as client:
            with pytest.raises(RuntimeRequestError, match="structural_tag") as info:
                client.generate("hi there", sampling_params={"max_new_tokens": 4, "structural_tag": "[" * 30_000})
            assert info.value.code == "bad_request"
            submit = engine.core.submit

            def broken_submit(req):
                monkeypatch.setattr(engine.core, "submit", submit)  # once
                raise RuntimeError("a bug in queueing")

            monkeypatch.setattr(engine.core, "submit", broken_submit)
            with pytest.raises(RuntimeRequestError, match="a bug in queueing") as info:
                client.generate("hi there", sampling_params={"max_new_tokens": 4})
            assert info.value.code == "internal"
        still_serving(server.address)
    finally:
        server.stop()


# What a schema that only refers to itself is refused with: sgl_lite's own check of the compiled grammar
# ("admits no output"), or, where xgrammar finds the loop itself while compiling (0.2.9 does), its message.
SELF_REFERENCE = r"admits no output|Circular \$ref chain"


@pytest.mark.parametrize("schema", [
    {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
    {"$ref": "#"},
])
def test_a_self_referencing_schema_is_a_bad_request(engine, tmp_path, schema):
    server = ServerThread(engine, f"ipc://{tmp_path / 'rt.sock'}")
    try:
        with RuntimeClient(server.address, timeout=60) as client:
            with pytest.raises(RuntimeRequestError, match=SELF_REFERENCE) as info:
                client.generate("hi", sampling_params={"max_new_tokens": 4, "json_schema": json.dumps(schema)})
            assert info.value.code == "bad_request"
        still_serving(server.address)
    finally:
        server.stop()


# ---------------------------------------------------------------------------- compile off the scheduler thread


def test_a_slow_compile_blocks_neither_the_scheduler_nor_a_trivial_regex_and_is_written_off(engine, tmp_path, monkeypatch):
    steps = 0
    real_step = engine.core.scheduler.step

    def counting_step():
        nonlocal steps
        steps += 1
        return real_step()

    monkeypatch.setattr(engine.core.scheduler, "step", counting_step)
    raise_caps(engine, monkeypatch)
    server = ServerThread(engine, f"ipc://{tmp_path / 'rt.sock'}")
    try:
        with RuntimeClient(server.address, timeout=120) as client:
            # The compile workers' fork server starts with the first constrained request (seconds: it imports xgrammar).
            client.generate("Answer:", sampling_params={"max_new_tokens": 4, "regex": "(yes|no)"})
            slow = client.generate_stream("hi", rid="slow", sampling_params={
                "max_new_tokens": 4, "json_schema": json.dumps(nested_schema(SLOW_LEVELS))})
            time.sleep(0.5)  # its compile has started
            assert engine.core.scheduler.stats()["num_grammar_pending"] == 1
            [slow_worker] = compiling_pids(engine)
            # While it compiles the loop waits instead of spinning (old: thousands of steps a second).
            steps_before = steps
            time.sleep(1.0)
            assert steps - steps_before < 400
            start = time.monotonic()
            plain = client.generate("The quick brown fox", sampling_params={"max_new_tokens": 4, "temperature": 0})
            regex = client.generate("Answer:", sampling_params={"max_new_tokens": 4, "regex": "(yes|no)"})
            assert time.monotonic() - start < 5.0, "a trivial request waited behind the slow compile"
            assert len(plain.output_ids) == 4 and regex.text in ("yes", "no")
            threads_before = compile_threads()
            client.abort("slow")  # nobody waits for its compile any more: its worker process is killed
            ended = list(slow)  # with no output: it never ran
            assert [c.output_ids for c in ended] == [[]] and ended[0].meta_info["finish_reason"]["type"] == "abort"
            wait_until(lambda: not engine.core.scheduler.stats()["num_grammar_pending"], "no grammar pending", 10,
                       poll_s=0.05)
            wait_until_gone(slow_worker)
            assert compile_threads() == threads_before  # the pool keeps its width: its threads start new workers
            regex = client.generate("Answer:", sampling_params={"max_new_tokens": 4, "regex": "(yes|no)"})
            assert regex.text in ("yes", "no")
    finally:
        server.stop()


def test_a_request_refused_by_a_full_queue_leaves_no_compile_behind(engine, monkeypatch):
    raise_caps(engine, monkeypatch, max_queued_requests=1)
    scheduler = engine.core.scheduler
    waiting = engine.core.make_req("waiting", "hi", None, {"max_new_tokens": 4})
    scheduler.add_request(waiting)
    refused = engine.core.make_req("refused", "hi", None, {"max_new_tokens": 4, "json_schema": nested_schema(SLOW_LEVELS)})
    with pytest.raises(QueueFullError):
        scheduler.add_request(refused)
    backend = scheduler.validator._grammar_backend
    key = grammar_key(refused.sampling_params)
    assert key not in backend._waiters and key not in backend._compiled  # cancelled or written off, and forgotten
    assert scheduler.abort_request("waiting")
    engine.core.step()
    assert not scheduler.has_work()


def test_a_compile_past_its_time_budget_is_refused(engine, tmp_path, monkeypatch):
    raise_caps(engine, monkeypatch, grammar_compile_timeout=1.0)
    server = ServerThread(engine, f"ipc://{tmp_path / 'rt.sock'}")
    try:
        with RuntimeClient(server.address, timeout=60) as client:
            start = time.monotonic()
            with pytest.raises(RuntimeRequestError, match="--grammar-compile-timeout 1 s") as info:
                client.generate("hi", sampling_params={"max_new_tokens": 4,
                                                       "json_schema": json.dumps(nested_schema(SLOW_LEVELS + 1))})
            assert info.value.code == "bad_request"
            assert time.monotonic() - start < 5.0
        still_serving(server.address)
    finally:
        server.stop()


def test_runaway_compiles_queued_behind_busy_workers_are_refused_as_bad_requests_too(engine, tmp_path, monkeypatch):
    """More runaway compiles than workers: those still queued when their time runs out are cancelled, and they get
    the same 400 as the running ones (once, a cancelled compile's CancelledError became a 500)."""
    raise_caps(engine, monkeypatch, grammar_compile_timeout=1.0)
    server = ServerThread(engine, f"ipc://{tmp_path / 'rt.sock'}")
    try:
        with RuntimeClient(server.address, timeout=120) as client:
            errors: list[BaseException] = []
            regexes = [RUNAWAY_REGEX + suffix for suffix in "xyzw"]  # distinct specs: no shared compile
            threads = [threading.Thread(target=_expect_error, args=(client, regex, errors)) for regex in regexes]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert len(errors) == len(regexes)
            assert all(isinstance(e, RuntimeRequestError) and e.code == "bad_request"
                       and "--grammar-compile-timeout 1 s" in e.message for e in errors), errors
        still_serving(server.address)
        # the refused compiles' workers are killed: none is left for the next test
        wait_until(lambda: not compiling_pids(engine), lambda: f"no compile running, not {compiling_pids(engine)}",
                   poll_s=0.05)
    finally:
        server.stop()


def test_a_refused_runaway_compile_stops_using_cpu_and_the_runtime_keeps_serving(engine, tmp_path, monkeypatch):
    raise_caps(engine, monkeypatch, grammar_compile_timeout=3.0)
    server = ServerThread(engine, f"ipc://{tmp_path / 'rt.sock'}")
    try:
        with RuntimeClient(server.address, timeout=120) as client:
            client.generate("Answer:", sampling_params={"max_new_tokens": 4, "regex": "(yes|no)"})  # workers ready
            refused: list[BaseException] = []
            waiter = threading.Thread(target=lambda: _expect_error(client, RUNAWAY_REGEX, refused))
            waiter.start()
            wait_until(lambda: compiling_pids(engine), "the runaway compile's worker", 10)
            [worker] = compiling_pids(engine)
            spent = cpu_seconds(worker)
            waiter.join(60)
            assert refused and "--grammar-compile-timeout 3 s" in str(refused[0])
            assert refused[0].code == "bad_request"
            wait_until_gone(worker)  # killed at the refusal: its CPU time stops there
            assert spent is not None
            # The pool lets go of the compile once its worker thread sees the kill (the runner restarting its
            # process meanwhile), not at the instant the process dies.
            wait_until(lambda: not compiling_pids(engine), lambda: f"no compile running, not {compiling_pids(engine)}",
                       poll_s=0.05)
            regex = client.generate("Answer:", sampling_params={"max_new_tokens": 4, "regex": "(yes|no)"})
            assert regex.text in ("yes", "no")
        still_serving(server.address)
    finally:
        server.stop()


def _expect_error(client: RuntimeClient, regex: str, errors: list[BaseException]) -> None:
    try:
        client.generate("hi", sampling_params={"max_new_tokens": 4, "regex": regex})
    except RuntimeRequestError as e:
        errors.append(e)


def test_a_compile_past_its_cpu_time_limit_ends_its_worker(tiny_tokenizer):
    """The worker's own backstop (RLIMIT_CPU), for when nobody kills it: the compile fails naming the
    limit, and the next compile gets a new worker."""
    from sgl_lite.runtime.sampling.grammar import GrammarBackend

    backend = GrammarBackend(tiny_tokenizer, len(tiny_tokenizer), eos_token_ids=[tiny_tokenizer.eos_token_id],
                             max_workers=1, cpu_seconds=1.0)
    try:
        with pytest.raises(ValueError, match="more than 1 s of CPU time"):
            backend.request_matcher(SamplingParams(regex=RUNAWAY_REGEX)).result(120)
        backend.request_matcher(SamplingParams(regex="(yes|no)")).result(60)
        assert backend._pool._runners[0].starts == 2
    finally:
        backend.shutdown()


def test_sigterm_exits_promptly_while_a_grammar_compiles(tiny_model):
    args = {**SERVER_ARGS, **RAISED_CAPS}
    with Runtime(model_path=tiny_model, startup_timeout=180, client_timeout=60, **args) as rt:
        stream = rt.client.generate_stream("hi", sampling_params={"max_new_tokens": 4,
                                                                  "json_schema": json.dumps(nested_schema(SLOW_LEVELS + 2))})
        wait_until(lambda: rt.client.server_info()["num_grammar_pending"], "a grammar pending", poll_s=0.05)
        time.sleep(0.5)
        start = time.monotonic()
        rt.process.send_signal(signal.SIGTERM)
        rt.process.wait(30)
        assert time.monotonic() - start < 5.0, "SIGTERM waited for the compile"
        with pytest.raises(Exception):
            list(stream)


def test_a_compile_worker_that_cannot_start_fails_its_request_not_the_scheduler(engine, monkeypatch):
    from sgl_lite.runtime.sampling.compile_process import CompileProcess

    def broken(self, kind, text, cpu_seconds):
        raise RuntimeError("the grammar compile fork server failed: no processes left")

    monkeypatch.setattr(CompileProcess, "compile", broken)
    core = engine.core
    req = core.make_req("fork-fails", "hi", None, {"max_new_tokens": 4, "regex": "(maybe|perhaps)+"})
    core.submit(req)
    deadline = time.monotonic() + 30
    while not req.finished:
        assert time.monotonic() < deadline
        core.step()
        time.sleep(0.01)
    assert req.finished_reason.error_code == "internal" and "fork server failed" in req.finished_reason.message
    monkeypatch.undo()
    assert engine.generate("hi", {"max_new_tokens": 4, "regex": "(yes|no)"})["text"] in ("yes", "no")
