"""Running programs: one state per run, a thread pool for run_batch, and the batch prefix hint.

Before a batch fans out, the program body is traced once, with placeholders for the batch's
arguments, up to its first model call (gen, select, fork) or the first use of an argument: the
constant text every item would send first. When it is longer than 64 characters it is prefilled
once, so the batch's requests all hit the prefix cache instead of prefilling it side by side.
Tracing executes the body's Python code up to that point once (as SGLang's tracer does), so side
effects there happen once more than the batch's items.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

from sgl_lite.lang.backend.base import BaseBackend, PrefillRequest
from sgl_lite.lang.executor import StreamExecutor
from sgl_lite.lang.function import running_state
from sgl_lite.lang.global_config import global_config
from sgl_lite.lang.ir import SglExpr, SglSamplingParams
from sgl_lite.lang.state import ProgramState

if TYPE_CHECKING:
    from sgl_lite.lang.function import SglFunction

logger = logging.getLogger(__name__)

# Programs sharing a constant prefix at least this long get one prefill before the batch starts.
MIN_SHARED_PREFIX_CHARS = 64


def resolve_backend(backend: Optional[Any]) -> BaseBackend:
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise RuntimeError("no backend: call sgl.set_default_backend(sgl.Runtime(...)) or pass backend=")
    if hasattr(backend, "endpoint"):  # sgl.Runtime wraps its RuntimeEndpoint
        backend = backend.endpoint
    if not isinstance(backend, BaseBackend):
        raise TypeError(f"backend must be an sgl.RuntimeEndpoint or sgl.Runtime; got {type(backend).__name__}")
    return backend


def _run_body(program: SglFunction, state: ProgramState, args: tuple, kwargs: dict[str, Any], *,
              reraise: bool) -> None:
    """Run the body; its exception is recorded on the state (s.error(), reads of missing variables) and,
    with `reraise`, raised to the caller of run(), as SGLang does."""
    executor = state.stream_executor
    token = running_state.set(state)
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except Exception as e:
        executor.fail(e)
        if reraise:
            raise
        logger.warning("program %s raised %r", program.func.__name__, e)
    finally:
        running_state.reset(token)
        executor.end()


def run_program(
    program: SglFunction,
    backend: Optional[Any],
    args: tuple,
    kwargs: dict[str, Any],
    defaults: SglSamplingParams,
    stream: bool = False,
    use_thread: bool = True,
    reraise: bool = True,
) -> ProgramState:
    backend = resolve_backend(backend)
    kwargs = {**program.bind_arguments, **kwargs}
    state = ProgramState(StreamExecutor(backend, defaults, stream, use_thread=use_thread))
    if stream:
        # The body runs in the background so the caller can iterate the stream right away.
        # The body runs in the background so the caller can iterate the stream right away; its error
        # can only be recorded on the state (run() has returned).
        threading.Thread(target=_run_body, args=(program, state, args, kwargs), kwargs={"reraise": False},
                         daemon=True).start()
    else:
        _run_body(program, state, args, kwargs, reraise=reraise)
    return state


class _StopTracing(BaseException):
    """Raised at a traced program's first model call (BaseException: user `except Exception` must not catch it)."""


class _TracingBackend(BaseBackend):
    def __init__(self, real: BaseBackend) -> None:
        self.real = real

    def get_chat_template(self):  # type: ignore[no-untyped-def]
        return self.real.get_chat_template()

    def generate(self, text, params):  # type: ignore[no-untyped-def]
        raise _StopTracing

    def generate_stream(self, text, params):  # type: ignore[no-untyped-def]
        raise _StopTracing

    def prefill(self, requests: list[PrefillRequest]) -> list[dict[str, Any]]:
        raise _StopTracing

    def select(self, text, choices, temperature, choices_method):  # type: ignore[no-untyped-def]
        raise _StopTracing

    def flush_cache(self) -> bool:
        raise _StopTracing

    def get_server_info(self) -> dict[str, Any]:
        return self.real.get_server_info()


class _TracingExecutor(StreamExecutor):
    """The executor of a traced body: an expression it cannot run (a _TracedArgument appended, or one
    holding it) ends the trace, as a model call does, instead of failing the program with a warning:
    the trace is a hint, and the program's real runs report their own errors."""

    def _run_one(self, expr: SglExpr) -> None:
        try:
            self._execute(expr)
        except Exception as e:
            raise _StopTracing from e


class _TracedArgument(SglExpr):
    """An argument of the batch while its prefix is traced: the text before it is every item's. Appended,
    it ends the trace (the executor cannot run it); used as a value (str, f-string, len, iteration,
    truth), it ends the statement that uses it (_StopTracing, which the body's `except Exception` does
    not catch); anything else it raises is an Exception and ends the trace too."""

    def __str__(self) -> str:
        raise _StopTracing

    def __format__(self, spec: str) -> str:
        raise _StopTracing

    def __len__(self) -> int:
        raise _StopTracing

    def __iter__(self) -> Iterator[Any]:
        raise _StopTracing

    def __getitem__(self, key: Any) -> Any:
        raise _StopTracing

    def __bool__(self) -> bool:
        raise _StopTracing


def trace_prefix(program: SglFunction, backend: BaseBackend, arg_names: set[str]) -> str:
    """The text a program builds before its first model call or the first use of one of `arg_names`."""
    executor = _TracingExecutor(_TracingBackend(backend), SglSamplingParams(), use_thread=False)
    state = ProgramState(executor)
    token = running_state.set(state)
    try:
        program.func(state, **{**program.bind_arguments, **{name: _TracedArgument() for name in arg_names}})
    except (_StopTracing, Exception):
        pass
    finally:
        running_state.reset(token)
    return executor.text_


def cache_batch_prefix(program: SglFunction, backend: BaseBackend, batch: list[dict[str, Any]]) -> str:
    """Prefill the batch's shared leading text when it is long enough; return what was prefilled."""
    prefix = trace_prefix(program, backend, {name for kwargs in batch for name in kwargs})
    if len(prefix) <= MIN_SHARED_PREFIX_CHARS:
        return ""
    backend.cache_prefix(prefix)
    return prefix


def _run_to_completion(program: SglFunction, backend: BaseBackend, kwargs: dict[str, Any],
                       defaults: SglSamplingParams) -> ProgramState:
    # A failing program of a batch reports on its own state; the others' results are kept.
    state = run_program(program, backend, (), kwargs, defaults, reraise=False)
    state.sync()  # a pool slot stays busy until its program is done: num_threads bounds concurrency
    return state


def run_program_batch(
    program: SglFunction,
    backend: Optional[Any],
    batch: list[dict[str, Any]],
    defaults: SglSamplingParams,
    num_threads: Union[str, int],
    progress_bar: bool,
    generator_style: bool = False,
) -> Union[list[ProgramState], Iterator[ProgramState]]:
    backend = resolve_backend(backend)
    if not batch:
        return iter(()) if generator_style else []
    if len(batch) > 1:
        try:
            cache_batch_prefix(program, backend, batch)
        except Exception as e:  # a hint only: a failure here must not fail the batch
            logger.warning("batch prefix hint failed: %r", e)
    if num_threads == "auto":
        num_threads = max(96, multiprocessing.cpu_count() * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or a positive int; got {num_threads!r}")
    num_threads = min(num_threads, len(batch))
    results = _iter_batch(program, backend, batch, defaults, num_threads, progress_bar)
    return results if generator_style else list(results)


def _iter_batch(program: SglFunction, backend: BaseBackend, batch: list[dict[str, Any]], defaults: SglSamplingParams,
                num_threads: int, progress_bar: bool) -> Iterator[ProgramState]:
    import tqdm

    bar = tqdm.tqdm(total=len(batch)) if progress_bar else None
    try:
        with ThreadPoolExecutor(num_threads, thread_name_prefix="sgl-batch") as pool:
            futures = [pool.submit(_run_to_completion, program, backend, kwargs, defaults) for kwargs in batch]
            if bar is not None:
                for future in futures:
                    future.add_done_callback(lambda _: bar.update())
            for future in futures:
                yield future.result()
    finally:
        if bar is not None:
            bar.close()
