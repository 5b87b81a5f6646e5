"""SGLang flags and request fields a user will type (issue 19, item 6): implemented, or accepted with a
one-line explanation where they mean nothing on this build. Tiny random model, loopback only."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from pathlib import Path

import click
import pytest
import requests
from click.testing import CliRunner

from sgl_lite.cli import build_server_args, server_arg_options
from sgl_lite.lang.launcher import Runtime, _child_env
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.server.event_loop import RuntimeServer

pytestmark = pytest.mark.timeout(300)


@click.command()
@server_arg_options
def parse_only(**values):
    click.echo(repr(dataclasses.asdict(build_server_args(values))))


def _parsed(*argv: str) -> dict:
    result = CliRunner().invoke(parse_only, list(argv))
    assert result.exit_code == 0, result.output
    return eval(result.output)  # noqa: S307 - our own repr of a dict of plain values


def test_sglang_spellings_and_accepted_flags_parse():
    values = _parsed("--model", "/models/x", "--tp", "2", "--trust-remote-code", "--enable-metrics",
                     "--kv-cache-dtype", "auto", "--page-size", "1", "--grammar-backend", "xgrammar",
                     "--stream-interval", "4", "--watchdog-timeout", "60", "--disable-overlap-schedule",
                     "--cuda-graph-max-bs", "64", "--disable-cuda-graph")
    assert values["model_path"] == "/models/x" and values["tp_size"] == 2
    assert values["trust_remote_code"] and values["enable_metrics"] and values["disable_overlap_schedule"]
    assert values["cuda_graph_max_bs"] == 64 and values["disable_cuda_graph"]
    assert values["stream_interval"] == 4 and values["watchdog_timeout"] == 60.0


@pytest.mark.parametrize("argv, says", [
    (["--page-size", "16"], "only 1 is supported"),
    (["--kv-cache-dtype", "bf16"], "model's dtype"),
    (["--grammar-backend", "outlines"], "xgrammar"),
    (["--stream-interval", "0"], "--stream-interval"),
])
def test_what_this_build_lacks_is_one_clear_line(argv, says):
    result = CliRunner().invoke(parse_only, argv)
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output


def test_stream_interval_sends_a_chunk_every_n_tokens(tiny_llama_dir, tmp_path):
    with Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=512) as engine:
        args = engine.args.replace(host=f"ipc://{tmp_path / 'rt.sock'}", stream_interval=4)
        server = RuntimeServer(engine.core, args)
        server.bind()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            with RuntimeClient(server.address, timeout=60) as client:
                params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
                chunks = list(client.generate_stream("Hello there", sampling_params=params))
                whole = client.generate("Hello there", sampling_params=params)
                # A request's own stream_interval (SGLang's sampling param) wins over the server's.
                own = list(client.generate_stream("Hello there", sampling_params={**params, "stream_interval": 3}))
        finally:
            server.request_shutdown()
            thread.join(30)
        progress = [c.meta_info["completion_tokens"] for c in chunks[:-1]]
        # SGLang's rule: the first token at once, then every 4 unsent; the last chunk (token 10) comes with the end
        assert progress == [1, 5, 9]
        assert [c.meta_info["completion_tokens"] for c in own[:-1]] == [1, 4, 7]
        assert "".join(c.text for c in chunks) == whole.text == "".join(c.text for c in own)
        engine.core.scheduler.check_invariant()


def test_watchdog_ends_a_process_whose_step_hangs():
    # The real watchdog over a stand-in whose step began 10 s ago, in a process of its own (it exits).
    script = ("import time; from sgl_lite.runtime.server.process import _start_watchdog\n"
              "class Hung: step_started_at = time.monotonic() - 10\n"
              "class Whole: lost_ranks = staticmethod(lambda: None)\n"
              "_start_watchdog(Hung(), Whole(), 0.5); time.sleep(30)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20,
                            env=_child_env())
    assert result.returncode == 1 and "--watchdog-timeout" in result.stderr


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir: Path):
    rt = Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, client_timeout=60, dtype="float32",
                 max_total_tokens=2048, log_level="warning")
    yield rt
    rt.shutdown()


def test_generate_takes_n(runtime):
    body = {"text": "Once upon a time", "sampling_params": {"n": 3, "max_new_tokens": 6, "temperature": 1.0,
                                                            "seed": 7, "ignore_eos": True}}
    reply = requests.post(runtime.url + "/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()
    assert isinstance(results, list) and len(results) == 3
    assert all(len(r["output_ids"]) == 6 for r in results)
    assert len({tuple(r["output_ids"]) for r in results}) > 1  # seed + i: the samples differ
    again = requests.post(runtime.url + "/generate", json=body, timeout=60).json()
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in results]  # and are reproducible
    batch = requests.post(runtime.url + "/generate", timeout=60, json={
        "text": ["a", "b"], "sampling_params": {"n": 2, "max_new_tokens": 2}}).json()
    assert len(batch) == 4
    for bad in (0, 1000, "2"):
        refused = requests.post(runtime.url + "/generate", timeout=60, json={
            "text": "a", "sampling_params": {"n": bad, "max_new_tokens": 2}})
        assert refused.status_code == 400 and "sampling_params.n" in refused.text
