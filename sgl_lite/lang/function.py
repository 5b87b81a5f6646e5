"""SglFunction: what @sgl.function makes of a Python function whose first parameter is `s`."""

from __future__ import annotations

import contextvars
import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

from sgl_lite.lang.ir import SglFunctionCall, SglSamplingParams

if TYPE_CHECKING:
    from sgl_lite.lang.backend.base import BaseBackend
    from sgl_lite.lang.state import ProgramState

# The state whose program body is running in this thread/context: a call to another @function
# inside a body becomes an inlined call instead of a separate program run.
running_state: contextvars.ContextVar[Optional[ProgramState]] = contextvars.ContextVar("running_state", default=None)


class SglFunction:
    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: Optional[int] = None,
                 bind_arguments: Optional[dict[str, Any]] = None) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "s":
            raise TypeError(f"the first parameter of @function {func.__name__} must be named 's'")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.arg_names = [p.name for p in params[1:] if p.kind in positional]
        self.arg_defaults = [p.default for p in params[1:] if p.kind in positional and p.default is not p.empty]

    def __repr__(self) -> str:
        return f"SglFunction({self.func.__name__})"

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no parameter(s) {', '.join(unknown)} to bind")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def call_on(self, state: ProgramState, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run this function's body on an existing state (a nested call)."""
        token = running_state.set(state)
        try:
            return self.func(state, *args, **{**self.bind_arguments, **kwargs})
        finally:
            running_state.reset(token)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from sgl_lite.lang.state import ProgramState

        if args and isinstance(args[0], ProgramState):
            return self.call_on(args[0], args[1:], kwargs)  # other(s, ...)
        if running_state.get() is not None:
            return SglFunctionCall(self, args, kwargs)  # s += other(...)
        return self.run(*args, **kwargs)

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: Optional[Union[str, list[str]]] = None,
        stop_token_ids: Optional[list[int]] = None,
        stop_regex: Optional[Union[str, list[str]]] = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None,
        priority: Optional[int] = None,
        stream: bool = False,
        backend: Optional[BaseBackend] = None,
        use_thread: bool = True,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once; the sampling arguments are the defaults of every gen in it."""
        from sgl_lite.lang.interpreter import run_program

        defaults = SglSamplingParams(
            max_new_tokens=max_new_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids, stop_regex=stop_regex,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs, priority=priority,
        )
        return run_program(self, backend, args, kwargs, defaults, stream=stream, use_thread=use_thread)

    def run_batch(
        self,
        batch_kwargs: Union[list[dict[str, Any]], list[tuple]],
        *,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: Optional[Union[str, list[str]]] = None,
        stop_token_ids: Optional[list[int]] = None,
        stop_regex: Optional[Union[str, list[str]]] = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None,
        priority: Optional[int] = None,
        backend: Optional[BaseBackend] = None,
        num_threads: Union[str, int] = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
    ) -> Union[list[ProgramState], Iterator[ProgramState]]:
        """Run the program once per argument set (dicts, or tuples in parameter order), concurrently.
        States come back in input order; a program that fails reports it on its own state only."""
        from sgl_lite.lang.interpreter import run_program_batch

        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(f"run_batch expects a list of argument dicts or tuples; got {type(batch_kwargs).__name__}")
        arguments = [self._as_kwargs(item) for item in batch_kwargs]
        defaults = SglSamplingParams(
            max_new_tokens=max_new_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids, stop_regex=stop_regex,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs, priority=priority,
        )
        return run_program_batch(self, backend, arguments, defaults, num_threads, progress_bar, generator_style)

    def _as_kwargs(self, item: Union[dict[str, Any], tuple, list]) -> dict[str, Any]:
        if isinstance(item, dict):
            return dict(item)
        if isinstance(item, (list, tuple)):
            required = len(self.arg_names) - len(self.arg_defaults)
            if not required <= len(item) <= len(self.arg_names):
                raise TypeError(f"{self.func.__name__}() takes {required} to {len(self.arg_names)} arguments; "
                                f"a batch item has {len(item)}")
            return dict(zip(self.arg_names, item))
        raise TypeError(f"run_batch items must be dicts or tuples; got {type(item).__name__}")
