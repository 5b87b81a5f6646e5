"""What a server prints: SGLang's batch lines, --log-requests, an access line per HTTP request, and
the start-up progress of sgl.Runtime (tiny random model)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from sgl_lite.cluster import free_port
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.server.engine import Engine

pytestmark = pytest.mark.timeout(240)

PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), token usage: ([\d.]+), "
                     r"#running-req: (\d+), #queue-req: (\d+), ")
DECODE = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+), token usage: ([\d.]+), "
                    r"gen throughput \(token/s\): ([\d.]+), #queue-req: (\d+), ")


def test_batch_lines_and_request_log(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sgl_lite.runtime.scheduler")
    engine = Engine(model_path=str(tiny_llama_dir), dtype="float32", max_total_tokens=2048,
                    decode_log_interval=4, log_requests=True)
    try:
        prompt = "The quick brown fox jumps over the lazy dog"
        n_prompt = len(engine.core.tokenizer(prompt)["input_ids"])
        params = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
        engine.generate(prompt, params)  # 1 prefill + 8 decode steps
        messages = [r.getMessage() for r in caplog.records if r.name == "sgl_lite.runtime.scheduler"]
        prefills = [PREFILL.fullmatch(m) for m in messages if m.startswith("Prefill batch")]
        decodes = [DECODE.fullmatch(m) for m in messages if m.startswith("Decode batch")]
        assert all(prefills) and all(decodes), messages
        assert [p.groups()[:3] for p in prefills] == [("1", str(n_prompt), "0")]  # type: ignore[union-attr]
        assert len(decodes) == 8 // 4  # every --decode-log-interval decode steps, not every step
        running, used = decodes[0].group(1), int(decodes[0].group(2))  # type: ignore[union-attr]
        assert running == "1" and n_prompt < used <= n_prompt + 9
        assert float(decodes[-1].group(4)) > 0  # type: ignore[union-attr]
        (finish,) = [m for m in messages if m.startswith("Finish:")]
        assert f"prompt_tokens={n_prompt}, completion_tokens=9" in finish and repr(prompt) in finish

        caplog.clear()
        engine.generate(prompt, params)  # the prompt is cached now
        messages = [r.getMessage() for r in caplog.records if r.name == "sgl_lite.runtime.scheduler"]
        (again,) = [PREFILL.fullmatch(m) for m in messages if m.startswith("Prefill batch")]
        assert again is not None and int(again.group(3)) == n_prompt - 1 and again.group(2) == "1"
        stats = engine.get_server_info()
        assert stats["generated_tokens_total"] == 18 and stats["num_finished_requests"] == 2
    finally:
        engine.shutdown()


def test_runtime_start_progress_and_http_access_lines(tiny_llama_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    runtime = Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, dtype="float32")
    port = free_port()
    front = subprocess.Popen([sys.executable, "-m", "sgl_lite.http.launch", "--runtime", runtime.address,
                              "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        err = capfd.readouterr().err
        assert "sgl.Runtime: starting `sgl-lite serve`" in err
        start, ready = err.index("sgl.Runtime: starting"), err.index("sgl.Runtime: ready at")
        assert err[start:ready].count("\n") > 1  # the child's start-up log, passed on in between
        assert f"sgl.Runtime: ready at {runtime.url} (DSL over {runtime.address})" in err
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < deadline and front.poll() is None, "HTTP front did not start"
            time.sleep(0.2)
        httpx2.post(f"http://127.0.0.1:{port}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                    timeout=60)
    finally:
        front.terminate()
        front.wait(10)
        runtime.shutdown()
    access = front.stdout.read()  # type: ignore[union-attr]
    assert "sgl_lite.http.access: GET /health 200 " in access and "sgl_lite.http.access: POST /generate 200 " in access, access
