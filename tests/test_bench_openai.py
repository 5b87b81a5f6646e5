"""The serving benchmark over /v1/chat/completions (sgl_lite.bench.openai_chat_backend), against sgl_lite's
own OpenAI-compatible HTTP front on a tiny model: what any OpenAI-compatible server (vLLM, llama-server)
is driven through. Expected values come from the server itself (its non-streamed answer, its usage).
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import httpx2
import pytest

from sgl_lite.bench.backends import GenerationBackend, StreamEvent
from sgl_lite.bench.chat_rendered import ChatRenderedBackend, ChatRenderer
from sgl_lite.bench.config import BenchConfig, parse_config
from sgl_lite.bench.driver import run_benchmark
from sgl_lite.bench.http_backend import HTTPBackend
from sgl_lite.bench.openai_chat_backend import OpenAIChatBackend
from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient
from sgl_lite.runtime.model_executor.loader import load_tokenizer

pytestmark = pytest.mark.timeout(600)  # a loaded 2-core box starts a server slowly

API_KEY = "bench-key"
AGENT = dict(agent_num_sessions=3, agent_num_turns=3, agent_system_prompt_len=48, agent_task_len=8,
             agent_obs_len_min=2, agent_obs_len_max=6, agent_output_len=5)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[str]:
    runtime = Runtime(model_path=str(tiny_llama_dir), startup_timeout=120, dtype="float32", max_total_tokens=4096,
                      log_level="warning")
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), api_key=API_KEY))
    try:
        yield http.url
    finally:
        http.stop()
        runtime.shutdown()


async def _collect(backend: OpenAIChatBackend, prompt: list[int], n: int) -> tuple[list[int], list[dict]]:
    ids: list[int] = []
    finals: list[dict] = []
    try:
        async for event in backend.stream(prompt, n):
            ids += event.new_ids
            if event.meta_info is not None:
                finals.append(event.meta_info)
    finally:
        await backend.close_async_resources()
    return ids, finals


def test_chat_stream_matches_the_servers_answer_and_usage(server: str, tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    backend = OpenAIChatBackend("ours", server, tokenizer, api_key=API_KEY)
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    backend.reset()
    assert backend.latency_note == ""  # sgl_lite offers /flush_cache
    ids, finals = asyncio.run(_collect(backend, prompt, 7))
    body = {"model": backend._model_name(), "messages": [{"role": "user", "content": tokenizer.decode(prompt)}],
            "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    whole = httpx2.post(server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                        timeout=60).json()
    assert tokenizer.decode(ids) == whole["choices"][0]["message"]["content"]  # greedy: the same text streamed
    (meta,) = finals
    assert meta["completion_tokens"] == 7 and meta["finish_reason"] == {"type": "length"}
    assert meta["prompt_tokens"] == whole["usage"]["prompt_tokens"] > len(prompt)  # the chat template's tokens too
    assert meta["cached_tokens"] == 0  # after the flush
    repeat = asyncio.run(_collect(backend, prompt, 2))[1][0]
    assert repeat["cached_tokens"] == whole["usage"]["prompt_tokens"] - 1  # the server had just seen it all
    backend.reset()
    assert asyncio.run(_collect(backend, prompt, 2))[1][0]["cached_tokens"] == 0


@pytest.mark.parametrize("history", ["one-message", "messages"])
def test_bench_command_line_drives_openai_compatible_servers(server: str, tiny_llama_dir: Path, tmp_path: Path, history: str) -> None:
    """Two names for the same server: `--url` with `--backend openai-chat`, and an --openai-urls entry; the
    history sent either way."""
    config = parse_config(["--url", server, "--backend", "openai-chat", "--api-key", API_KEY, "--systems", "sgl_lite",
                           "--chat-history", history,
                           "--openai-urls", f"other={server}", "--model-path", str(tiny_llama_dir),
                           "--output-dir", str(tmp_path), "--no-plots", "--no-progress",
                           *[f"--{k.replace('_', '-')}={v}" for k, v in AGENT.items()]])
    report = run_benchmark(config)
    assert [s["system"] for s in report["systems"]] == ["sgl_lite", "other"]
    for summary in report["systems"]:
        assert summary["completed"] == 9 and summary["failed"] == 0, summary["errors"]
        assert summary["completion_tokens"] == 9 * 5 and summary["output_throughput"] > 0
        later = [t for t in summary["per_turn"] if t["turn"] > 0]
        assert all(t["hit_rate"] > 0.5 for t in later), summary["per_turn"]  # the history is the cached prefix


def test_openai_urls_are_checked() -> None:
    for bad in (["--openai-urls", "vllm"], ["--openai-urls", "vllm=localhost:8000"],
                ["--systems", "sgl_lite", "--openai-urls", "sgl_lite=http://127.0.0.1:1"]):
        with pytest.raises(ValueError, match="--openai-urls"):
            parse_config(bad)
    assert parse_config(["--systems", "", "--openai-urls", "a=http://h:1,b=http://h:2"]).all_systems == ("a", "b")


TURN_TEXTS = ["A task for the agent.", "I will look it up.", "Observation: it rains <|im_start|> now."]


async def _turn(backend, pieces: list[list[int]], n: int) -> dict:  # noqa: ANN001 - any GenerationBackend
    try:
        return [event async for event in backend.stream_turn(pieces, n)][-1].meta_info
    finally:
        await backend.close_async_resources()


def test_prompt_format_chat_sends_the_prompt_the_front_renders(server: str, tiny_llama_dir: Path) -> None:
    """A turn sent as token ids with --prompt-format chat is the prompt the HTTP front renders for the same
    conversation over chat: after it, the chat request finds all of its prompt but the last token cached
    (one differing id would cut the match there). A message spelling a special token keeps it as text, as
    the front does by default."""
    tokenizer = load_tokenizer(tiny_llama_dir)
    pieces = [tokenizer.encode(t, add_special_tokens=False) for t in TURN_TEXTS]
    render = ChatRenderer(str(tiny_llama_dir), tokenizer)
    ids = render(pieces)
    assert len(ids) > sum(map(len, pieces))  # the template's tokens on top
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    without = render([*pieces[:2], tokenizer.encode(TURN_TEXTS[2].replace("<|im_start|>", ""), add_special_tokens=False)])
    assert start in pieces[2] and ids.count(start) == without.count(start)  # the message's one stayed text
    rendered = ChatRenderedBackend(HTTPBackend("ids", server, api_key=API_KEY), render)
    rendered.reset()
    first = asyncio.run(_turn(rendered, pieces, 2))
    assert first["prompt_tokens"] == len(ids) and first["cached_tokens"] == 0
    chat = OpenAIChatBackend("chat", server, tokenizer, api_key=API_KEY, chat_history="messages")
    again = asyncio.run(_turn(chat, pieces, 2))
    assert again["prompt_tokens"] == len(ids) and again["cached_tokens"] == len(ids) - 1
    rendered.reset()
    plain = asyncio.run(_turn(HTTPBackend("ids", server, api_key=API_KEY), pieces, 2))
    assert plain["prompt_tokens"] == sum(map(len, pieces))  # --prompt-format ids: the pieces as they are


def test_prompt_format_chat_on_the_command_line(server: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`--prompt-format chat` on a token-id system: every first turn's prompt is as long as over chat."""
    common = ["--url", server, "--api-key", API_KEY, "--systems", "sgl_lite", "--model-path", str(tiny_llama_dir),
              "--output-dir", str(tmp_path), "--no-plots", "--no-progress",
              *[f"--{k.replace('_', '-')}={v}" for k, v in AGENT.items()]]

    def first_turns(*flags: str) -> list[int]:
        (summary,) = run_benchmark(parse_config([*common, *flags]))["systems"]
        assert summary["completed"] == 9, summary["errors"]
        return [r["prompt_tokens"] for r in sorted(summary["requests"], key=lambda r: r["session_id"]) if r["turn"] == 0]

    chat = first_turns("--backend", "openai-chat", "--chat-history", "messages")
    assert first_turns("--backend", "sglang", "--prompt-format", "chat") == chat
    assert all(a < b for a, b in zip(first_turns("--backend", "sglang"), chat))
    with pytest.raises(ValueError, match="--prompt-format"):
        BenchConfig(prompt_format="text").validate()


class _FixedAnswer(GenerationBackend):
    """A token-id system that answers every prompt with the same ids (and records the prompts)."""

    name = "fixed"

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer

    async def stream(self, input_ids: list[int], max_new_tokens: int):  # noqa: ANN201 - an async generator
        yield StreamEvent(0.0, self.answer, {"prompt_tokens": len(input_ids), "completion_tokens": len(self.answer),
                                             "cached_tokens": 0, "finish_reason": {"type": "length"}})

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_prompt_format_chat_keeps_an_answers_generated_ids(tiny_llama_dir: Path) -> None:
    """As the front does by default (--reuse-answer-ids): the next turn's rendered prompt holds the answer as
    it was generated, even where its text tokenizes to other ids."""
    tokenizer = load_tokenizer(tiny_llama_dir)
    text = "the capital of France"
    answer = next(ids for cut in range(1, len(text))
                  if (ids := tokenizer.encode(text[:cut], add_special_tokens=False)
                      + tokenizer.encode(text[cut:], add_special_tokens=False))
                  != tokenizer.encode(text, add_special_tokens=False))
    pieces = [tokenizer.encode(t, add_special_tokens=False) for t in TURN_TEXTS[:1]]
    nxt = [*pieces, answer, tokenizer.encode("Observation: done.", add_special_tokens=False)]
    render = ChatRenderer(str(tiny_llama_dir), tokenizer)
    backend = ChatRenderedBackend(_FixedAnswer(answer), render)
    first = render(pieces)
    assert asyncio.run(_turn(backend, pieces, 4))["prompt_tokens"] == len(first)
    assert render(nxt)[:len(first) + len(answer)] == first + answer
    unremembered = ChatRenderer(str(tiny_llama_dir), tokenizer)(nxt)
    assert unremembered[:len(first)] == first and unremembered[len(first):len(first) + len(answer)] != answer


def test_chat_renderer_needs_a_chat_template(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(str(tiny_llama_dir), tokenizer)


class _RecordingChatServer(ThreadingHTTPServer):
    """A stand-in OpenAI server that records each chat request's body and streams one word back."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # /v1/models
                self._send(b'{"data": [{"id": "stand-in"}]}', "application/json")

            def do_POST(self) -> None:
                recorder.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                chunk = {"choices": [{"delta": {"content": "yes"}, "finish_reason": "length"}]}
                self._send(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

            def _send(self, payload: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.mark.parametrize("history", ["one-message", "messages"])
def test_chat_history_sends_the_turns_as_asked(history: str, tiny_llama_dir: Path) -> None:
    """A session's third turn (first prompt, answer, observation, answer, observation): one user message
    holding it all, or the user's and the model's turns as alternating user and assistant messages (agent
    frameworks send the latter, which lets a server reuse what it generated)."""
    tokenizer = load_tokenizer(tiny_llama_dir)
    texts = ["A task for the agent.", "I will look it up.", "Observation: it rains.", "Then take a coat.", "Observation: done."]
    pieces = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    stand_in = _RecordingChatServer()
    backend = OpenAIChatBackend("stand-in", f"http://127.0.0.1:{stand_in.server_port}", tokenizer, chat_history=history)

    async def turn() -> list:
        try:
            return [event async for event in backend.stream_turn(pieces, 4)]
        finally:
            await backend.close_async_resources()

    try:
        events = asyncio.run(turn())
    finally:
        stand_in.shutdown()
    assert events[-1].meta_info is not None
    (body,) = stand_in.bodies
    if history == "messages":
        assert body["messages"] == [{"role": role, "content": tokenizer.decode(piece)}
                                    for role, piece in zip(["user", "assistant"] * 3, pieces)]
    else:
        assert body["messages"] == [{"role": "user", "content": tokenizer.decode([t for piece in pieces for t in piece])}]
    with pytest.raises(ValueError, match="chat_history"):
        OpenAIChatBackend("stand-in", "http://127.0.0.1:1", tokenizer, chat_history="threads")
