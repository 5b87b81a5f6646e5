"""A soak workload for a running runtime server: many clients, shared prefixes, aborts, disconnects.

Used by tests/test_reliability_soak.py (hundreds of requests) and scripts/soak.py (thousands). Most
traffic goes through bare DEALER sockets so that every message is seen and recorded per request. A
few workers use RuntimeClient (blocking, streaming, close() with requests in flight), and a few client
subprocesses are SIGKILLed mid-stream. soak_checks.py checks the outcome: exactly one final message
(Finished or ErrorReply) per request and nothing after it, streams adding up to the final text, greedy
outputs equal to an unloaded in-process Engine's, and the idle accounting invariant.
"""

from __future__ import annotations

import os
import queue
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from sgl_lite.runtime import protocol
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError, RuntimeUnavailableError, use_api_key
from sgl_lite.testing.killed_clients import kill_client_processes

_WORDS = ("the quick brown fox jumps over lazy dog journey of thousand miles begins with single step "
          "what is capital France Paris Berlin Germany thought should call tool action search weather "
          "observation sunny degrees def add return numbers name Alice age tags score helpful assistant "
          "answer question final Unicode café naïve résumé 東京 Привет").split()


@dataclass
class SoakConfig:
    num_requests: int = 600
    raw_workers: int = 6  # bare DEALER sockets, several requests in flight each
    api_workers: int = 2  # RuntimeClient users
    in_flight_per_worker: int = 4
    max_new_tokens: tuple[int, int] = (1, 8)
    long_fraction: float = 0.08  # greedy ignore_eos requests of up to long_max_new tokens (force retraction)
    long_max_new: int = 24
    sampled_fraction: float = 0.15
    stream_fraction: float = 0.5
    abort_fraction: float = 0.05
    disconnect_fraction: float = 0.01  # the socket / client is closed with requests in flight
    killed_client_processes: int = 2
    num_prefixes: int = 6
    prefix_words: tuple[int, int] = (5, 40)
    suffix_words: tuple[int, int] = (1, 12)
    distinct_suffixes: int = 8  # per prefix: repeats make exact cache hits
    priority_range: tuple[int, int] = (0, 100)
    # A request may wait long (static priorities let a low one starve while urgent ones keep coming),
    # but it must get its final message before this many seconds after the last request was sent.
    drain_timeout: float = 900.0
    # No request finished for this long while some wait: a stalled server. The soak prints the server's stats and
    # records a problem (a stall otherwise shows only as its clients waiting, up to drain_timeout).
    stall_report_s: float = 120.0
    rss_checkpoints: int = 3  # RSS samples after each 1/n of the requests
    # Aborts the client did not ask for are problems unless their message holds one of these.
    expected_abort_reasons: tuple[str, ...] = ("higher priority",)
    seed: int = 0


@dataclass
class RequestRecord:
    rid: str
    prompt: str
    params: dict[str, Any]
    stream: bool
    priority: int
    action: str  # "", "abort", "disconnect"
    sent_at: float = 0.0
    chunks: list[str] = field(default_factory=list)
    chunk_ids: list[int] = field(default_factory=list)
    finals: list[protocol.Reply] = field(default_factory=list)
    after_final: list[protocol.Reply] = field(default_factory=list)
    disconnected: bool = False  # its client went away on purpose: no final can be delivered
    wait_s: float = 0.0  # from sending it to its final message
    api_error: str | None = None

    @property
    def greedy(self) -> bool:
        return self.params.get("temperature", 1.0) == 0.0

    @property
    def final(self) -> protocol.Reply | None:
        return self.finals[0] if self.finals else None


@dataclass
class SoakResult:
    records: list[RequestRecord]
    duration_s: float
    rss_kib: list[int]  # server RSS after each checkpoint
    problems: list[str]
    killed_clients: int

    def summary(self) -> dict[str, Any]:
        finals = [r.final for r in self.records if r.final is not None]
        codes: dict[str, int] = {}
        reasons: dict[str, int] = {}  # error messages up to their first colon or digit
        for f in finals:
            if isinstance(f, protocol.ErrorReply):
                codes[f.code] = codes.get(f.code, 0) + 1
                reason = re.split(r"[:(0-9]", f.message, maxsplit=1)[0].strip()
                reasons[reason] = reasons.get(reason, 0) + 1
        return {
            "requests": len(self.records),
            "duration_s": round(self.duration_s, 1),
            "finished": sum(isinstance(f, protocol.Finished) for f in finals),
            "errors": codes,
            "error_reasons": reasons,
            "disconnected": sum(r.disconnected for r in self.records),
            "max_wait_s": round(max((r.wait_s for r in self.records), default=0.0), 1),
            "killed_client_processes": self.killed_clients,
            "rss_mib": [round(k / 1024, 1) for k in self.rss_kib],
            "problems": len(self.problems),
        }


def rss_kib(pid: int) -> int:
    """VmRSS of a process from /proc (KiB)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def make_records(config: SoakConfig) -> list[RequestRecord]:
    rng = random.Random(config.seed)
    prefixes = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(*config.prefix_words)))
                for _ in range(config.num_prefixes)]
    suffixes = [[" ".join(rng.choice(_WORDS) for _ in range(rng.randint(*config.suffix_words)))
                 for _ in range(config.distinct_suffixes)] for _ in prefixes]
    records = []
    for i in range(config.num_requests):
        p = rng.randrange(len(prefixes))
        prompt = prefixes[p] + " " + rng.choice(suffixes[p])
        roll = rng.random()
        if roll < config.long_fraction:
            params = {"max_new_tokens": rng.randint(config.max_new_tokens[1] + 1, config.long_max_new),
                      "temperature": 0.0, "ignore_eos": True}
        elif roll < config.long_fraction + config.sampled_fraction:
            params = {"max_new_tokens": rng.randint(*config.max_new_tokens), "temperature": 0.8, "top_p": 0.9,
                      "seed": rng.randrange(2**31)}
        else:
            params = {"max_new_tokens": rng.randint(*config.max_new_tokens), "temperature": 0.0}
        action_roll = rng.random()
        action = ("abort" if action_roll < config.abort_fraction else
                  "disconnect" if action_roll < config.abort_fraction + config.disconnect_fraction else "")
        records.append(RequestRecord(rid=f"soak-{i}", prompt=prompt, params=params,
                                     stream=rng.random() < config.stream_fraction,
                                     priority=rng.randint(*config.priority_range), action=action))
    return records


class _Progress:
    """Counts requests that are done (final seen or given up) and samples the server's RSS."""

    def __init__(self, total: int, pid: int | None, checkpoints: int) -> None:
        self.total, self.pid = total, pid
        self.done = 0
        self.lock = threading.Lock()
        self.marks = [round(total * (k + 1) / checkpoints) for k in range(checkpoints)]
        self.rss: list[int] = []

    def one_done(self) -> None:
        with self.lock:
            self.done += 1
            while self.marks and self.done >= self.marks[0]:
                self.marks.pop(0)
                if self.pid is not None:
                    self.rss.append(rss_kib(self.pid))


class _RawWorker:
    """One DEALER socket at a time; records every reply. `disconnect` closes it with requests in flight."""

    def __init__(self, address: str, api_key: str | None, tasks: queue.Queue, config: SoakConfig,
                 progress: _Progress, problems: list[str], rng: random.Random) -> None:
        self.address, self.api_key, self.tasks, self.config = address, api_key, tasks, config
        self.progress, self.problems, self.rng = progress, problems, rng
        self.context = zmq.Context()
        self.socket = self._connect()
        self.in_flight: dict[str, RequestRecord] = {}
        self.abort_at: dict[str, float] = {}
        self.finished: dict[str, RequestRecord] = {}  # final seen: watch for anything after it

    def _connect(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        use_api_key(sock, self.api_key)
        sock.connect(self.address)
        return sock

    def run(self) -> None:
        drain_deadline: float | None = None
        try:
            while True:
                self._fill()
                if not self.in_flight:
                    break
                if drain_deadline is None and self.tasks.empty():
                    drain_deadline = time.monotonic() + self.config.drain_timeout
                self._act()
                if self.socket.poll(50):
                    while self.socket.poll(0):
                        self._route(protocol.decode_reply(self.socket.recv()))
                if drain_deadline is not None and time.monotonic() > drain_deadline:
                    self._give_up()
                    break
            # Late messages (nothing may follow a final): listen a little longer.
            deadline = time.monotonic() + 0.5
            while self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                self._route(protocol.decode_reply(self.socket.recv()))
        finally:
            self.socket.close(linger=0)
            self.context.term()

    def _fill(self) -> None:
        while len(self.in_flight) < self.config.in_flight_per_worker:
            try:
                rec = self.tasks.get_nowait()
            except queue.Empty:
                return
            rec.sent_at = time.monotonic()
            msg = protocol.GenerateReq(rec.rid, text=rec.prompt, sampling_params=protocol.SamplingParams(**rec.params),
                                       stream=rec.stream, priority=rec.priority)
            self.socket.send(protocol.encode(msg))
            self.in_flight[rec.rid] = rec
            if rec.action:
                self.abort_at[rec.rid] = rec.sent_at + self.rng.uniform(0.0, 0.3)

    def _act(self) -> None:
        now = time.monotonic()
        for rid, when in list(self.abort_at.items()):
            if when > now:
                continue
            del self.abort_at[rid]
            rec = self.in_flight.get(rid)
            if rec is None:
                continue
            if rec.action == "abort":
                self.socket.send(protocol.encode(protocol.AbortReq(rid)))
            else:  # disconnect: every request of this socket is left behind without a final
                for left in self.in_flight.values():
                    left.disconnected = True
                    self.progress.one_done()
                self.in_flight.clear()
                self.abort_at.clear()
                self.finished.clear()
                self.socket.close(linger=0)
                self.socket = self._connect()
                return

    def _route(self, reply: protocol.Reply) -> None:
        if isinstance(reply, protocol.InfoReply) and reply.rid == "":
            return  # keepalive
        rec = self.in_flight.get(reply.rid)
        if rec is None:
            done = self.finished.get(reply.rid)
            if done is None:
                self.problems.append(f"reply for an unknown rid {reply.rid!r}: {reply}")
            elif isinstance(reply, protocol.ErrorReply) and reply.message.startswith("unknown request id"):
                pass  # the answer to an AbortReq that arrived after the request had finished
            else:
                done.after_final.append(reply)
            return
        if isinstance(reply, protocol.TokenChunk):
            rec.chunks.append(reply.text)
            rec.chunk_ids.extend(reply.output_ids)
            return
        rec.finals.append(reply)
        rec.wait_s = time.monotonic() - rec.sent_at
        del self.in_flight[reply.rid]
        self.abort_at.pop(reply.rid, None)
        self.finished[reply.rid] = rec
        self.progress.one_done()

    def _give_up(self) -> None:
        now = time.monotonic()
        for rid, rec in self.in_flight.items():
            self.problems.append(f"{rid}: no final message after {now - rec.sent_at:.0f} s")
            self.progress.one_done()
        self.in_flight.clear()


def _api_worker(address: str, api_key: str | None, tasks: queue.Queue, progress: _Progress) -> None:
    """RuntimeClient users: blocking and streaming calls; a disconnect closes the client mid-stream."""
    client = RuntimeClient(address, api_key=api_key, timeout=600)
    try:
        while True:
            try:
                rec = tasks.get_nowait()
            except queue.Empty:
                return
            rec.sent_at = time.monotonic()
            options = dict(priority=rec.priority, rid=rec.rid)
            try:
                if rec.action == "disconnect":
                    stream = client.generate_stream(rec.prompt, sampling_params=rec.params, **options)
                    for _ in stream:
                        break
                    client.close()  # aborts what it has in flight
                    rec.disconnected = True
                    client = RuntimeClient(address, api_key=api_key, timeout=600)
                elif rec.stream:
                    chunks = list(client.generate_stream(rec.prompt, sampling_params=rec.params, **options))
                    rec.chunks = [c.text for c in chunks]
                    rec.chunk_ids = [t for c in chunks for t in c.output_ids]
                    meta = chunks[-1].meta_info
                    text = "".join(rec.chunks)
                    rec.finals.append(protocol.Finished(rec.rid, text, list(rec.chunk_ids), meta))
                else:
                    rec.finals.append(client.generate(rec.prompt, sampling_params=rec.params, **options))
            except RuntimeRequestError as e:
                if rec.disconnected:
                    pass
                else:
                    rec.finals.append(protocol.ErrorReply(rec.rid, e.message, e.code))
            except RuntimeUnavailableError as e:
                rec.api_error = str(e)
            rec.wait_s = time.monotonic() - rec.sent_at
            progress.one_done()
    finally:
        client.close()


def _report_stall(address: str, api_key: str | None, progress: _Progress, after_s: float, stop: threading.Event,
                  problems: list[str]) -> None:
    """Once no request has finished for `after_s` while some remain, print the server's queues, slots and tier."""
    done, since = progress.done, time.monotonic()
    while not stop.wait(1.0):
        if progress.done != done:
            done, since = progress.done, time.monotonic()
        elif time.monotonic() - since >= after_s:
            try:
                with RuntimeClient(address, api_key=api_key, timeout=10) as client:
                    info = client.server_info()
                state: Any = {k: v for k, v in info.items() if k.startswith(("num_", "slots_", "hicache_"))}
            except Exception as e:  # the stall may be the server's death: say so instead
                state = f"no answer ({e})"
            message = f"no request finished for {after_s:g} s ({done} of {progress.total} done); the server: {state}"
            print(f"soak: {message}", flush=True)
            problems.append(message)
            return


def run_soak(address: str, config: SoakConfig, *, server_pid: int | None = None, api_key: str | None = None,
             child_env: dict[str, str] | None = None) -> SoakResult:
    records = make_records(config)
    rng = random.Random(config.seed + 1)
    raw_tasks: queue.Queue = queue.Queue()
    api_tasks: queue.Queue = queue.Queue()
    for rec in records:
        (api_tasks if config.api_workers and rng.random() < config.api_workers / (config.api_workers + config.raw_workers)
         else raw_tasks).put(rec)
    progress = _Progress(len(records), server_pid, config.rss_checkpoints)
    problems: list[str] = []
    killed: list[int] = []
    stop = threading.Event()
    started = time.monotonic()
    threads = [threading.Thread(target=_RawWorker(address, api_key, raw_tasks, config, progress, problems,
                                                  random.Random(config.seed + 10 + w)).run, name=f"soak-raw-{w}")
               for w in range(config.raw_workers)]
    threads += [threading.Thread(target=_api_worker, args=(address, api_key, api_tasks, progress), name=f"soak-api-{w}")
                for w in range(config.api_workers)]
    killer = threading.Thread(target=kill_client_processes,
                              args=(address, api_key, config.killed_client_processes, child_env or dict(os.environ),
                                    stop, random.Random(config.seed + 2), killed, _WORDS))
    reporter = threading.Thread(target=_report_stall, args=(address, api_key, progress, config.stall_report_s, stop,
                                                           problems), daemon=True)
    for t in (*threads, killer, reporter):
        t.start()
    for t in threads:
        t.join()
    stop.set()
    killer.join()
    duration = time.monotonic() - started
    return SoakResult(records, duration, progress.rss, problems, len(killed))
