"""ProgramState (the `s` of a program) and ProgramStateGroup (what `s.fork(n)` returns)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

from sgl_lite.lang.executor import StreamExecutor
from sgl_lite.lang.ir import (
    SglCommitLazy,
    SglConstantText,
    SglExpr,
    SglFunctionCall,
    SglRoleBegin,
    SglRoleEnd,
    SglVarScopeBegin,
    SglVarScopeEnd,
)

# Streaming readers wake at least this often to notice the end of the program.
_STREAM_POLL_SECONDS = 0.05


class ProgramState:
    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    # ------------------------------------------------------------ appending

    def __iadd__(self, other: Union[SglExpr, str]) -> ProgramState:
        if other is None:
            raise ValueError("tried to append None to a program state")
        if isinstance(other, SglFunctionCall):
            # A nested @function runs its body on this very state, like an inlined call.
            other.function.call_on(self, other.args, other.kwargs)
            return self
        if isinstance(other, str):
            other = SglConstantText(other)
        if not isinstance(other, SglExpr):
            raise TypeError(f"cannot append {type(other).__name__} to a program state")
        self.stream_executor.submit(other)
        return self

    def _role(self, role: str, expr: Optional[Union[SglExpr, str]]) -> Any:
        if expr is not None:
            self += SglRoleBegin(role) + expr + SglRoleEnd(role)
            return None

        @contextlib.contextmanager
        def scope() -> Iterator[None]:
            self.stream_executor.submit(SglRoleBegin(role))
            yield
            self.stream_executor.submit(SglRoleEnd(role))

        return scope()

    def system(self, expr: Optional[Union[SglExpr, str]] = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Optional[Union[SglExpr, str]] = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Optional[Union[SglExpr, str]] = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes variable `name`."""
        self.stream_executor.submit(SglVarScopeBegin(name))
        yield
        self.stream_executor.submit(SglVarScopeEnd(name))

    # ------------------------------------------------------------ fork / copy

    def fork(self, size: int = 1, position_ids_offset: Optional[list[int]] = None) -> ProgramStateGroup:
        """`size` branches continuing from the current text. Before fanning out, the shared text is
        prefilled once (a prefix-cache hint) so the branches all start from a cache hit."""
        executor = self.stream_executor
        size = int(size)
        if size < 1:
            raise ValueError(f"fork size must be >= 1; got {size}")
        if size > 1:
            executor.submit(SglCommitLazy())
        executor.sync()
        branches = [ProgramState(executor.branch()) for _ in range(size)]
        return ProgramStateGroup(branches, self, fork_text_len=len(executor.text_))

    @contextlib.contextmanager
    def copy(self, position_ids_offset: Optional[list[int]] = None) -> Iterator[ProgramState]:
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # ------------------------------------------------------------ reading

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.stream_executor.sync()
        return self.stream_executor.messages_

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> Optional[BaseException]:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.variables[name] = value

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    # ------------------------------------------------------------ streaming

    def _pieces(self, var_name: Optional[str]) -> Iterator[Optional[str]]:
        """New text as it appears (None: nothing new yet, caller waits); ends when complete."""
        executor = self.stream_executor
        sent = 0
        while True:
            executor.stream_event.clear()
            if var_name is None:
                done = executor.is_finished
                current = executor.text_
            else:
                event = executor.variable_event.get(var_name)
                done = executor.is_finished or (event is not None and event.is_set())
                current = executor.variables.get(var_name, "")
                current = current if isinstance(current, str) else ""
            if len(current) > sent:
                yield current[sent:]
                sent = len(current)
            elif done:
                return
            else:
                yield None

    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Yield the program text (or one variable) piece by piece as it is generated."""
        if not self.stream_executor.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        for piece in self._pieces(var_name):
            if piece is None:
                self.stream_executor.stream_event.wait(_STREAM_POLL_SECONDS)
            else:
                yield piece

    async def text_async_iter(self, var_name: Optional[str] = None) -> AsyncIterator[str]:
        """text_iter for asyncio code: waiting happens off the event loop."""
        loop = asyncio.get_running_loop()
        if not self.stream_executor.stream:
            value = await loop.run_in_executor(None, lambda: self.text() if var_name is None else self.get_var(var_name))
            yield value
            return
        for piece in self._pieces(var_name):
            if piece is None:
                await loop.run_in_executor(None, self.stream_executor.stream_event.wait, _STREAM_POLL_SECONDS)
            else:
                yield piece


class ProgramStateGroup:
    """The branches of a fork. `+=` appends to every branch (a callable gets the branch index; a
    list gives one item per branch); `join()` waits for all branches and copies each variable new
    in the branches back into the parent as a list (one value per branch)."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState, fork_text_len: int = 0) -> None:
        self.states = states
        self.src_state = src_state
        self.fork_text_len = fork_text_len  # where each branch's own text starts (for concate_and_append)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `forks[i] += x` rebinds forks[i] to the same state; anything else is a mistake.
        if value is not self.states[i]:
            raise TypeError("fork branches cannot be replaced")

    def __iadd__(self, other: Union[SglExpr, str, Callable[[int], Any], list, tuple]) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, SglExpr):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"fork group has {len(self.states)} branches but {len(other)} items were given")
            for state, item in zip(self.states, other):
                state += item
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable new in the branches becomes a list in the parent.
        concate_and_append (SGLang's spelling): the branches' new text, in branch order, is appended
        to the parent's text (as text: the runtime's radix cache makes its prefix a cache hit)."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append'; got {mode!r}")
        parent = self.src_state.stream_executor
        parent_names = set(parent.variables)
        appended = []
        for state in self.states:
            child = state.stream_executor
            child.end()
            child.sync()
            if mode == "concate_and_append":
                appended.append(child.text_[self.fork_text_len:])
            else:
                for name in child.variables:
                    if name in parent_names:
                        continue
                    value = child.variables[name]
                    parent.variables.setdefault(name, []).append(value)
                    parent.meta_info.setdefault(name, []).append(child.meta_info.get(name))
            if child.error_ is not None:
                parent.record_error(child.error_)
        if appended:
            self.src_state += "".join(appended)
