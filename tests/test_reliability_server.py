"""Faults in a real `sgl-lite serve` process: injected forward-pass failures (SGL_LITE_FAULT_INJECT test
hook) and SIGTERM with requests in flight."""

from __future__ import annotations

import threading

import pytest

from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError
from sgl_lite.runtime.model_executor.fault_injection import ENV_VAR
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

pytestmark = pytest.mark.timeout(300)

SERVER_ARGS = dict(dtype="float32", device="cpu", context_length=512, max_total_tokens=4096, log_level="warning")
PROMPTS = ["The quick brown fox", "What is the capital of France?", "def add(a, b):", "Berlin is the capital of",
           "A journey of a thousand miles", "Thought: I should call a tool."]
SHORT = {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}
LONG = {"max_new_tokens": 480, "temperature": 0.0, "ignore_eos": True}


def run_concurrently(client: RuntimeClient, prompts: list[str], params: dict) -> dict[str, object]:
    results: dict[str, object] = {}

    def ask(prompt: str) -> None:
        try:
            results[prompt] = client.generate(prompt, sampling_params=params)
        except RuntimeRequestError as e:
            results[prompt] = e

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_injected_forward_faults_cost_only_their_batches(tiny_model, monkeypatch):
    with Engine(model_path=tiny_model, **SERVER_ARGS) as engine:
        reference = {p: engine.generate(p, dict(SHORT))["output_ids"] for p in PROMPTS}
    monkeypatch.setenv(ENV_VAR, "forward:5")  # the server process inherits it
    with Runtime(model_path=tiny_model, startup_timeout=180, client_timeout=60, **SERVER_ARGS) as rt:
        monkeypatch.delenv(ENV_VAR)
        client = rt.client
        failed, served = 0, 0
        # One at a time (a pass or two each, so some requests miss every 5th pass), then all at once.
        rounds = [{p: run_concurrently(client, [p], SHORT)[p] for p in PROMPTS} for _ in range(2)]
        rounds.append(run_concurrently(client, PROMPTS, SHORT))
        for result_of in rounds:
            for prompt, result in result_of.items():
                if isinstance(result, RuntimeRequestError):
                    assert result.code == "aborted"
                    assert "forward pass failed: InjectedFault" in result.message and f"{ENV_VAR}=forward:5" in result.message
                    failed += 1
                else:
                    assert result.output_ids == reference[prompt], prompt
                    served += 1
        assert failed > 0 and served > 0
        assert_idle_without_leaks(client)
        rt.shutdown()
        assert rt.process.returncode == 0, rt.stderr_tail()
    assert "InjectedFault" in rt.stderr_tail()  # the failure is logged with its traceback


def test_sigterm_aborts_every_in_flight_request_with_a_reason(tiny_model):
    with Runtime(model_path=tiny_model, startup_timeout=180, client_timeout=60, **SERVER_ARGS) as rt:
        clients = [RuntimeClient(rt.address, timeout=60) for _ in range(3)]
        errors: dict[int, BaseException | None] = {}
        first_chunks = threading.Barrier(len(clients) + 1)

        def stream(i: int) -> None:
            chunks = clients[i].generate_stream(PROMPTS[i], sampling_params=LONG)
            try:
                next(chunks)
                first_chunks.wait()
                for _ in chunks:
                    pass
                errors[i] = None
            except BaseException as e:  # noqa: BLE001 - checked below
                errors[i] = e

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        first_chunks.wait()  # every stream is mid-generation
        rt.process.terminate()
        for t in threads:
            t.join(60)
        assert rt.process.wait(30) == 0, rt.stderr_tail()
        for c in clients:
            c.close()
    assert sorted(errors) == [0, 1, 2]
    for i, error in errors.items():
        assert isinstance(error, RuntimeRequestError), (i, error)
        assert error.code == "aborted" and "server shutting down" in error.message
