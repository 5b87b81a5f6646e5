"""StreamExecutor: runs one program state's expressions, in order, on its own worker thread.

`submit` queues an expression and returns at once; the worker executes expressions one after the
other against the backend. Readers wait on per-variable events: `get_var("x")` blocks until the
gen/select that sets x has run. Invariant: once the worker stops (end of program or an error),
every variable event is set, so no reader blocks forever; a reader of a variable that was never
produced because of an error gets that error.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from typing import Any, Optional

from sgl_lite.lang.backend.base import BaseBackend
from sgl_lite.lang.chat_template import ChatTemplate
from sgl_lite.lang.ir import (
    SglCommitLazy,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglVarScopeBegin,
    SglVarScopeEnd,
    variable_names,
)

logger = logging.getLogger(__name__)


class ProgramError(RuntimeError):
    """A variable was read from a program that failed before producing it."""


class StreamExecutor:
    def __init__(
        self,
        backend: BaseBackend,
        default_params: SglSamplingParams,
        stream: bool = False,
        chat_template: Optional[ChatTemplate] = None,
        use_thread: bool = True,
    ) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.default_params = default_params
        self.stream = stream
        self.chat_template = chat_template or backend.get_chat_template()

        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self.error_: Optional[BaseException] = None
        self.is_finished = False
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos = 0
        # Set whenever text or a streamed variable grows (streaming readers poll on it).
        self.stream_event = threading.Event()

        self._lock = threading.Lock()
        self._queue: queue.Queue[Optional[SglExpr]] = queue.Queue()
        self._ended = False
        self._body_error: Optional[BaseException] = None
        self._scope_starts: dict[str, int] = {}  # var_scope name -> where its text starts (not a value)
        # Fork branches end with their parent at the latest, so no worker thread outlives its program.
        self.children: list[StreamExecutor] = []
        self.use_thread = use_thread
        if use_thread:
            self._worker = threading.Thread(target=self._work, name=f"sgl-program-{self.sid[:8]}", daemon=True)
            self._worker.start()

    # ------------------------------------------------------------ submission side

    def submit(self, expr: SglExpr) -> None:
        with self._lock:
            if self._ended:
                raise RuntimeError("cannot append to a program state that has ended")
            for name in variable_names(expr):
                event = threading.Event()
                if self.error_ is not None:
                    event.set()  # will never be produced: readers must not block
                self.variable_event[name] = event
            if self.use_thread:
                self._queue.put(expr)
                return
        self._run_one(expr)  # use_thread=False: execute in the caller's thread, right away
        self.stream_event.set()

    def sync(self) -> None:
        self._queue.join()

    def end(self) -> None:
        """No more expressions will come; the worker exits after the queued ones. Its branches end too: the
        flag and the list are taken under the lock branch() holds, so no branch is added after them."""
        with self._lock:
            already, self._ended = self._ended, True
            children = list(self.children)
            if not already and self.use_thread:
                self._queue.put(None)
        for child in children:
            child.end()
        if not already and not self.use_thread:
            self._finish()

    def branch(self) -> StreamExecutor:
        """A fork branch continuing from this executor's text, variables and role (call once its queue has
        drained); it ends with this executor at the latest. An ended executor has no branches: a worker
        started for one would never be ended."""
        with self._lock:
            if self._ended:
                raise RuntimeError("cannot fork a program state that has ended")
            child = StreamExecutor(self.backend, self.default_params, self.stream, self.chat_template, self.use_thread)
            self.children.append(child)
        child.variables = dict(self.variables)
        child.meta_info = dict(self.meta_info)
        child.text_ = self.text_
        child.messages_ = list(self.messages_)
        child.cur_role = self.cur_role
        child.cur_role_begin_pos = self.cur_role_begin_pos
        child.error_ = self.error_
        return child

    def fail(self, error: BaseException) -> None:
        """Record an error raised by the program body itself. Expressions it queued before raising
        still run; the error is reported once they have."""
        self._body_error = error
        self.end()

    def get_var(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise ProgramError(f"variable {name!r} was not produced: the program failed with {self.error_!r}") \
                from self.error_
        raise KeyError(f"program has no variable {name!r}")

    def get_meta_info(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        return self.meta_info.get(name)

    # ------------------------------------------------------------ worker side

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is None:
                self._finish()
                self._queue.task_done()
                return
            try:
                self._run_one(expr)
            finally:
                self._queue.task_done()
                self.stream_event.set()

    def record_error(self, error: BaseException) -> None:
        """The program failed (here, or in a fork branch it joined): the first error is what readers of
        every variable not yet produced get, and none of them may wait any longer."""
        with self._lock:
            if self.error_ is None:
                self.error_ = error
            for event in self.variable_event.values():
                event.set()

    def _run_one(self, expr: SglExpr) -> None:
        if self.error_ is not None:
            return  # after an error nothing more runs; the error is what readers get
        try:
            self._execute(expr)
        except Exception as e:  # surfaces on state.error() and on reads of the missing variables
            logger.warning("program %s failed: %r", self.sid[:8], e)
            self.record_error(e)

    def _finish(self) -> None:
        if self.error_ is None and self._body_error is not None:
            self.error_ = self._body_error
        self.is_finished = True
        for event in list(self.variable_event.values()):
            event.set()
        self.stream_event.set()

    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglExprList):
            for item in expr.expr_list:
                self._execute(item)
        elif isinstance(expr, SglConstantText):
            self._fill(expr.value)
        elif isinstance(expr, SglGen):
            self._execute_gen(expr)
        elif isinstance(expr, SglSelect):
            self._execute_select(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self._scope_starts[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            self.variables[expr.name] = self.text_[self._scope_starts.pop(expr.name):]
            self.variable_event[expr.name].set()
        elif isinstance(expr, SglCommitLazy):
            try:
                self.backend.cache_prefix(self.text_)
            except Exception as e:  # a hint: a backend that refuses it (vLLM: max_tokens=0) loses only the hint
                logger.debug("prefix hint not taken: %r", e)
        else:
            raise TypeError(f"cannot execute {expr!r}")

    def _fill(self, text: str) -> None:
        self.text_ += str(text)

    def _set_var(self, name: Optional[str], value: Any, meta_info: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta_info
        self.variable_event[name].set()

    def _execute_gen(self, expr: SglGen) -> None:
        params = expr.sampling_params.resolve(self.default_params)
        params.check_supported()
        if self.chat_template.stop_str:
            params.stop = params.stop_list() + [s for s in self.chat_template.stop_str if s not in params.stop_list()]
        if not self.stream:
            completion, meta_info = self.backend.generate(self.text_, params)
            self.text_ += completion
            self._set_var(expr.name, completion, meta_info)
            return
        # Streaming: the variable grows piece by piece; its event is set only when complete.
        name = expr.name
        if name is not None:
            self.variables[name] = ""
        try:
            for piece, meta_info in self.backend.generate_stream(self.text_, params):
                self.text_ += piece
                if name is not None:
                    self.variables[name] += piece
                    self.meta_info[name] = meta_info
                self.stream_event.set()
        except Exception:
            if name is not None:  # a gen that failed produced no value, streamed or not: readers get the error
                self.variables.pop(name, None)
                self.meta_info.pop(name, None)
            raise
        if name is not None:
            self.variable_event[name].set()

    def _execute_select(self, expr: SglSelect) -> None:
        decision = self.backend.select(self.text_, expr.choices, expr.temperature, expr.choices_method)
        self.text_ += decision.decision
        self._set_var(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}: roles cannot nest")
        template = self.chat_template
        if not self.messages_ and role != "system" and template.default_system_prompt:
            self._role_begin("system")
            self._fill(template.default_system_prompt)
            self._role_end("system")
        prefix, _ = template.get_prefix_and_suffix(role, self.messages_)
        self._fill(prefix)
        self.cur_role = role
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends, but the open role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos:]
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(suffix)
        self.cur_role = None
        self.messages_.append({"role": role, "content": content.lstrip()})
