"""Continuous hostile load over HTTP beside a benchmark's normal clients (scripts/bench_hostile.py):

- a prefill hog: each of its streams sends SGLang's /generate with a batch of long random prompts, as
  many tokens together as one request may prefill, and the next one as soon as it is answered (random
  ids: nothing of it is ever a cache hit). It starts with one batch just over that limit, which must be
  refused (400) before anything runs;
- a runaway grammar compile: a regex under every size limit whose compile outlasts
  --grammar-compile-timeout, sent again as soon as it is refused;
- a /health probe every `health_every_s` seconds.

Each counts its answers by status, with their latencies. Leaving the `with` cancels what is in flight:
the front aborts a request whose client hung up.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx2

from sgl_lite.http.guards.prompt_budget import BatchTokenLimit

# A 24 KB regex, under --max-grammar-chars, whose compile outlasts the default --grammar-compile-timeout.
RUNAWAY_REGEX = "(a|aa|aaa|aaaa)*" * 1500 + "b<i>"
_TIMEOUT_S = 600.0
_KEPT_MESSAGES = 3


@dataclass
class StreamStats:
    """What one kind of hostile request got: answers by HTTP status (or the exception's name), seconds each."""

    sent: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # the first few error answers

    def record(self, status: str, seconds: float, message: str = "") -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.seconds.append(seconds)
        if message and len(self.messages) < _KEPT_MESSAGES:
            self.messages.append(message[:300])

    def to_json(self) -> dict[str, Any]:
        done = sorted(self.seconds)
        return {"sent": self.sent, "answered": len(done), "statuses": self.statuses, "messages": self.messages,
                "seconds_median": done[len(done) // 2] if done else None, "seconds_max": done[-1] if done else None}


@dataclass(frozen=True)
class HogPlan:
    streams: int  # batches in flight at once
    prompts: int  # per batch
    prompt_tokens: int  # per prompt
    over_limit_prompts: int = 0  # the batch sent first, which must be refused (0: none)
    max_new_tokens: int = 8

    @classmethod
    def for_server(cls, info: dict[str, Any], streams: int, prompt_tokens: int, max_prompts: int | None = None) -> HogPlan:
        """Prompts of `prompt_tokens` (less what the context needs for the output), as many per batch as the
        server (its server_info) allows one request's prompts, at most `max_prompts`; the over-limit batch
        has one prompt more than the server allows."""
        context = int(info["context_length"])
        prompt_tokens = min(prompt_tokens, context - 2 * cls.max_new_tokens)
        limit = BatchTokenLimit.of_server(info.get("server_args") or {}, context)
        allowed = max(1, limit.tokens // prompt_tokens) if limit is not None else 32
        return cls(streams=streams, prompts=min(allowed, max_prompts or allowed), prompt_tokens=prompt_tokens,
                   over_limit_prompts=allowed + 1 if limit is not None else 0)


def soak_load(url: str, info: dict[str, Any], *, max_prompts: int, seed: int, api_key: str | None = None,
              tolerated: tuple[str, ...] = ()) -> HostileLoad:
    """The soak's hostile load (scripts/soak.py, tests/test_reliability_soak.py): one hog batch in flight, of
    `max_prompts` prompts as long as the context allows, random ids of the served vocabulary, and one runaway
    compile, against the server (its server_info `info`) at `url`."""
    rng = random.Random(seed)
    vocab_size = int(info["vocab_size"])
    hog = HogPlan.for_server(info, streams=1, prompt_tokens=int(info["context_length"]), max_prompts=max_prompts)
    return HostileLoad(url, lambda n: [rng.randrange(vocab_size) for _ in range(n)], hog=hog, compile_streams=1,
                       api_key=api_key, tolerated=tolerated)


def hostile_load_problems(report: dict[str, dict[str, Any]]) -> list[str]:
    """What a HostileLoad's report shows went wrong: a hog batch not answered 200, the over-limit batch not
    refused with 400, a runaway compile answered anything but 400 (or never answered), /health not 200;
    answers the load was told to tolerate are not problems."""
    expected = {"health": "200", "hog": "200", "hog over the limit": "400", "runaway compile": "400"}
    problems = []
    for name, stats in report.items():
        wrong = {status: n for status, n in stats["statuses"].items()
                 if status != expected[name] and not status.endswith(" tolerated")}
        if wrong:
            problems.append(f"{name}: answers {wrong} (expected {expected[name]}): {stats['messages']}")
        if not stats["answered"]:
            problems.append(f"{name}: {stats['sent']} sent, none answered")
    return problems


class HostileLoad:
    """The hostile streams against the HTTP API at `url`, from `with` to its end, on an event loop of
    their own thread. `draw_ids(n)`: n random token ids of the served model."""

    def __init__(self, url: str, draw_ids: Callable[[int], list[int]], *, hog: HogPlan | None = None,
                 compile_streams: int = 0, health_every_s: float = 1.0, api_key: str | None = None,
                 tolerated: tuple[str, ...] = ()) -> None:
        self.url = url.rstrip("/")
        self.draw_ids = draw_ids
        self.hog = hog
        self.compile_streams = compile_streams
        self.health_every_s = health_every_s
        self.tolerated = tolerated  # error texts counted as "<status> tolerated" (an injected fault's)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.stats: dict[str, StreamStats] = {"health": StreamStats()}
        if hog is not None:
            self.stats["hog"] = StreamStats()
            if hog.over_limit_prompts:
                self.stats["hog over the limit"] = StreamStats()
        if compile_streams:
            self.stats["runaway compile"] = StreamStats()
        self._loop = asyncio.new_event_loop()
        self._main: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, name="hostile-load", daemon=True)

    def __enter__(self) -> HostileLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        while self._main is None and self._thread.is_alive():
            time.sleep(0.01)
        if self._main is not None:
            self._loop.call_soon_threadsafe(self._main.cancel)
        self._thread.join(60)

    def wait_answered(self, timeout_s: float) -> bool:
        """Wait until every stream has had an answer (a short run may end before a runaway compile's
        refusal); False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while any(not stats.seconds for stats in self.stats.values()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def report(self) -> dict[str, Any]:
        return {name: stats.to_json() for name, stats in self.stats.items()}

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._all())
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.close()

    async def _all(self) -> None:
        self._main = asyncio.current_task()
        async with httpx2.AsyncClient(headers=self._headers, timeout=_TIMEOUT_S,
                                      limits=httpx2.Limits(max_connections=None)) as client:
            streams = [self._health(client)]
            if self.hog is not None:
                if self.hog.over_limit_prompts:
                    streams.append(self._over_limit_batch(client, self.hog))
                streams += [self._hog(client, self.hog) for _ in range(self.hog.streams)]
            streams += [self._runaway_compile(client) for _ in range(self.compile_streams)]
            await asyncio.gather(*streams)

    async def _timed(self, stats: StreamStats, request: Callable[[], Awaitable[httpx2.Response]]) -> None:
        stats.sent += 1
        started = time.perf_counter()
        try:
            response = await request()
        except httpx2.HTTPError as e:
            stats.record(type(e).__name__, time.perf_counter() - started, str(e))
            return
        ok = response.status_code == 200
        status = str(response.status_code)
        if not ok and any(text in response.text for text in self.tolerated):
            status += " tolerated"
        stats.record(status, time.perf_counter() - started, "" if ok else response.text)

    def _batch(self, hog: HogPlan, prompts: int) -> dict[str, Any]:
        return {"input_ids": [self.draw_ids(hog.prompt_tokens) for _ in range(prompts)],
                "sampling_params": {"max_new_tokens": hog.max_new_tokens, "ignore_eos": True, "temperature": 0}}

    async def _hog(self, client: httpx2.AsyncClient, hog: HogPlan) -> None:
        while True:
            body = self._batch(hog, hog.prompts)
            await self._timed(self.stats["hog"], lambda: client.post(self.url + "/generate", json=body))

    async def _over_limit_batch(self, client: httpx2.AsyncClient, hog: HogPlan) -> None:
        body = self._batch(hog, hog.over_limit_prompts)
        await self._timed(self.stats["hog over the limit"], lambda: client.post(self.url + "/generate", json=body))

    async def _runaway_compile(self, client: httpx2.AsyncClient) -> None:
        body = {"text": "Answer: ", "sampling_params": {"regex": RUNAWAY_REGEX, "max_new_tokens": 8}}
        while True:
            await self._timed(self.stats["runaway compile"], lambda: client.post(self.url + "/generate", json=body))

    async def _health(self, client: httpx2.AsyncClient) -> None:
        while True:
            await self._timed(self.stats["health"], lambda: client.get(self.url + "/health", timeout=30.0))
            await asyncio.sleep(self.health_every_s)
