"""SGLang's sessions, kept by the HTTP front: each session holds its requests' token ids (prompt and
output), so that a request naming an earlier one (`session_params.rid`) continues from its tokens
without the client resending them; the runtime's radix cache holds their KV, so the continuation
costs only its new tokens.

A session's requests form a tree, as in SGLang (srt/session/session_controller.py): a request
continues the one it names (its prompt and output, cut at `offset`, or only its prompt with
`drop_previous_output`), and several may continue the same one (branches). `replace` drops the
named request's later branches first (and, naming none, the whole session). A streaming session
appends each request to the latest one, one at a time. Each request stores only its own tokens (the
input it added and its output), so a chain of turns holds each token once.

Bounded: at most `max_sessions` open sessions; a session holds at most its `capacity_of_str_len`
tokens (a running request counts its input plus max_new_tokens until it ends); a session with no
running request expires after its idle timeout. Used only from the HTTP event loop, so no lock.

A session that ends (closed, or expired: noticed at the store's next use) is passed to `on_end`, which the
app points at the runtime's unpin_session, so its prefix stops being kept last in the radix cache; the
runtime also drops a pin by itself after the session's idle timeout.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Callable, Iterator

from sgl_lite.http.errors import HttpError, bad_request
from sgl_lite.runtime.protocol import MAX_SESSION_IDLE_S

MAX_OPEN_SESSIONS = 256
# The largest capacity_of_str_len (tokens) one session may ask for: 4 bytes a token in the front's memory.
MAX_SESSION_TOKENS = 262_144
SESSION_IDLE_TIMEOUT_S = 1800.0


def session_not_found(session_id: str) -> HttpError:
    return HttpError(404, f"session {session_id!r} is not open (never opened, closed, or expired after being idle)",
                     param="session_params.id", code="session_not_found")


@dataclass(frozen=True)
class Continuation:
    """What one request asks of its session (SGLang's SessionParams, resolved)."""

    rid: str | None = None  # the session request continued; None: a new root
    offset: int | None = None  # keep this many of its tokens (negative: all but that many); 0 or None: all
    replace: bool = False
    drop_previous_output: bool = False


@dataclass(eq=False)
class SessionRequest:
    """One request of a session (SGLang's SessionReqNode): its own tokens on top of `kept` tokens of its parent."""

    rid: str
    parent: SessionRequest | None
    kept: int  # how many of the parent's tokens (prompt, then output) its prompt starts with
    input_ids: array  # the tokens its prompt adds
    reserved: int  # tokens counted against the session's capacity while it runs
    output_ids: array | None = None  # None while it runs
    children: list[SessionRequest] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.output_ids is None

    @property
    def held(self) -> int:
        """The tokens this request counts against its session's capacity."""
        return self.reserved if self.output_ids is None else len(self.input_ids) + len(self.output_ids)

    def tokens(self, with_output: bool = True) -> list[int]:
        """Its prompt's token ids, then (`with_output`) its output's."""
        path = []
        node: SessionRequest | None = self
        while node is not None:
            path.append(node)
            node = node.parent
        ids: list[int] = []
        for node in reversed(path):
            del ids[node.kept:]
            ids.extend(node.input_ids)
            if node.output_ids is not None and (with_output or node is not self):
                ids.extend(node.output_ids)
        return ids

    def subtree(self) -> Iterator[SessionRequest]:
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children)


@dataclass(eq=False)
class Session:
    id: str
    capacity: int  # tokens
    streaming: bool
    timeout_s: float
    last_active: float
    requests: dict[str, SessionRequest] = field(default_factory=dict)
    latest: SessionRequest | None = None  # a streaming session's last finished request

    @property
    def held(self) -> int:
        return sum(node.held for node in self.requests.values())

    def running(self) -> list[SessionRequest]:
        return [node for node in self.requests.values() if node.running]

    def expired(self, now: float) -> bool:
        return now - self.last_active > self.timeout_s and not self.running()

    def continued(self, want: Continuation) -> SessionRequest | None:
        """The request `want` continues (checked: it exists; HttpError 400/404 otherwise)."""
        if self.streaming:
            for name, value in (("replace", want.replace), ("drop_previous_output", want.drop_previous_output),
                                ("offset", want.offset)):
                if value:
                    raise bad_request(f"session_params.{name}: a streaming session only appends", f"session_params.{name}")
            if self.running():
                raise bad_request("a streaming session runs one request at a time; this one's previous request "
                                  "has not finished", "session_params.id")
            return self.latest
        if want.rid is None:
            return None
        node = self.requests.get(want.rid)
        if node is None:
            raise HttpError(404, f"session_params.rid: {want.rid!r} is not a request of session {self.id!r} (or a "
                            "later request replaced it)", param="session_params.rid", code="session_request_not_found")
        return node

    def begin(self, rid: str, want: Continuation, input_ids: list[int], max_new_tokens: int,
              bos_token_id: int | None) -> tuple[SessionRequest, list[int], list[SessionRequest]]:
        """Register request `rid` of this session: the request, its whole prompt's ids, and the running requests
        that `replace` took away (for the caller to abort). HttpError, with nothing changed, when it cannot."""
        if rid in self.requests:
            raise bad_request(f"rid {rid!r} already names a request of session {self.id!r}", "rid")
        parent = self.continued(want)
        if parent is not None and parent.running:
            raise bad_request(f"session_params.rid: request {parent.rid!r} has not finished; continue it once it has, "
                              "or replace it (replace: true)", "session_params.rid")
        dropped = self.replaced_by(parent, want)
        kept = 0
        if parent is not None:
            if input_ids and input_ids[0] == bos_token_id:  # an appended turn does not start a new sequence
                input_ids = input_ids[1:]
            kept = _kept(parent, want)
        reserved = len(input_ids) + max_new_tokens
        room = self.capacity - (self.held - sum(node.held for node in dropped))
        if reserved > room:
            raise bad_request(f"session {self.id!r} holds {self.capacity - room} of its {self.capacity} tokens "
                              f"(capacity_of_str_len); this request needs {reserved} more (its {len(input_ids)} new "
                              f"input tokens + max_new_tokens {max_new_tokens})", "session_params")
        for node in dropped:
            self.requests.pop(node.rid, None)
        if want.replace and parent is not None:
            parent.children.clear()
        node = SessionRequest(rid, parent, kept, array("i", input_ids), reserved)
        if parent is not None:
            parent.children.append(node)
        self.requests[rid] = node
        return node, node.tokens(with_output=False), [n for n in dropped if n.running]

    def replaced_by(self, parent: SessionRequest | None, want: Continuation) -> list[SessionRequest]:
        """The requests `replace` drops: the continued request's later branches, or (naming none) all."""
        if not want.replace:
            return []
        if parent is None:
            return list(self.requests.values())
        return [node for child in parent.children for node in child.subtree()]

    def finish(self, node: SessionRequest, output_ids: list[int], now: float) -> None:
        """`node` ended with `output_ids` (finished or aborted): later requests may continue it."""
        node.output_ids = array("i", output_ids)
        node.done.set()
        self.last_active = now
        if self.streaming and self.requests.get(node.rid) is node:
            self.latest = node

    def forget(self, node: SessionRequest, now: float) -> None:
        """`node` ended without a result (an error, a cancelled request): it never was."""
        if self.requests.get(node.rid) is node:
            del self.requests[node.rid]
            if node.parent is not None and node in node.parent.children:
                node.parent.children.remove(node)
        node.done.set()
        self.last_active = now


def _kept(parent: SessionRequest, want: Continuation) -> int:
    """How many of `parent`'s tokens the continuation keeps (SGLang's slice `[:offset]`, 0 meaning all)."""
    base = len(parent.tokens(with_output=not want.drop_previous_output))
    if not want.offset:
        return base
    if not -base <= want.offset <= base:
        raise bad_request(f"session_params.offset {want.offset} is out of range: request {parent.rid!r} has {base} "
                          f"tokens to continue from (offset in [-{base}, {base}]; 0 keeps them all)",
                          "session_params.offset")
    return want.offset if want.offset > 0 else base + want.offset


class SessionStore:
    """The open sessions of one HTTP front (see the module docstring)."""

    def __init__(self, max_sessions: int = MAX_OPEN_SESSIONS, max_capacity: int = MAX_SESSION_TOKENS,
                 idle_timeout_s: float = SESSION_IDLE_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 on_end: Callable[[str], None] = lambda session_id: None) -> None:
        if max_sessions < 1 or max_capacity < 1 or not 0 < idle_timeout_s <= MAX_SESSION_IDLE_S:
            raise ValueError(f"a session store holds at least one session of one token, for some time (at most "
                             f"{MAX_SESSION_IDLE_S:g} s, the longest the runtime keeps a session's prefix)")
        self.max_sessions = max_sessions
        self.max_capacity = max_capacity
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.on_end = on_end  # told the id of every session that closes or expires
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        self._expire()
        return len(self._sessions)

    def open(self, capacity: int, session_id: str | None = None, streaming: bool = False,
             timeout_s: float | None = None) -> str:
        self._expire()
        if not 1 <= capacity <= self.max_capacity:
            raise bad_request(f"capacity_of_str_len (tokens a session holds) must be in [1, {self.max_capacity}]; "
                              f"got {capacity}", "capacity_of_str_len")
        if timeout_s is not None and not 0 < timeout_s <= self.idle_timeout_s:
            raise bad_request(f"timeout (idle seconds before the session closes) must be in (0, {self.idle_timeout_s:g}]; "
                              f"got {timeout_s:g}", "timeout")
        if session_id is not None and session_id in self._sessions:
            raise bad_request(f"session {session_id!r} is already open", "session_id")
        if len(self._sessions) >= self.max_sessions:
            raise HttpError(503, f"{len(self._sessions)} sessions are open, the most this server keeps; close one, or "
                            f"wait for an idle one to expire ({self.idle_timeout_s:g} s at most)", code="too_many_sessions")
        session_id = session_id if session_id is not None else uuid.uuid4().hex
        self._sessions[session_id] = Session(session_id, capacity, streaming,
                                             timeout_s if timeout_s is not None else self.idle_timeout_s, self.clock())
        return session_id

    def close(self, session_id: str) -> None:
        """Forget the session and its tokens; its running requests, as in SGLang, run on for their callers."""
        self._expire()
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise session_not_found(session_id)
        session.requests.clear()
        session.latest = None
        self.on_end(session_id)

    def get(self, session_id: str) -> Session:
        self._expire()
        session = self._sessions.get(session_id)
        if session is None:
            raise session_not_found(session_id)
        session.last_active = self.clock()
        return session

    def _expire(self) -> None:
        now = self.clock()
        for session_id in [s.id for s in self._sessions.values() if s.expired(now)]:
            del self._sessions[session_id]
            self.on_end(session_id)
