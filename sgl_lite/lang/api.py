"""The public DSL functions (`sgl.gen`, `sgl.select`, roles, backends). Names and defaults are SGLang's."""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Union

from sgl_lite.lang.choices import ChoicesSamplingMethod, token_length_normalized
from sgl_lite.lang.function import SglFunction
from sgl_lite.lang.global_config import global_config
from sgl_lite.lang.ir import (
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
)


def function(func: Optional[Callable[..., Any]] = None, num_api_spec_tokens: Optional[int] = None) -> Any:
    """`@function` or `@function(...)`: make a prompt program of a function whose first parameter is `s`."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)


def Runtime(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - SGLang's name
    """Start a runtime server process (sgl_lite.lang.launcher.Runtime); imported on first use."""
    from sgl_lite.lang.launcher import Runtime as _Runtime

    return _Runtime(*args, **kwargs)


def set_default_backend(backend: Any) -> None:
    global_config.default_backend = backend


def _endpoint(backend: Any) -> Any:
    backend = backend if backend is not None else global_config.default_backend
    return getattr(backend, "endpoint", backend)


def flush_cache(backend: Any = None) -> bool:
    backend = _endpoint(backend)
    if backend is None:
        return False
    return backend.flush_cache()


def get_server_info(backend: Any = None) -> Optional[dict[str, Any]]:
    backend = _endpoint(backend)
    if backend is None:
        return None
    return backend.get_server_info()


def gen(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    min_tokens: Optional[int] = None,
    n: Optional[int] = None,
    stop: Optional[Union[str, list[str]]] = None,
    stop_token_ids: Optional[list[int]] = None,
    stop_regex: Optional[Union[str, list[str]]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: Optional[bool] = None,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: Optional[bool] = None,
    dtype: Optional[Union[type, str]] = None,
    choices: Optional[list[str]] = None,
    choices_method: Optional[ChoicesSamplingMethod] = None,
    regex: Optional[str] = None,
    json_schema: Optional[str] = None,
) -> SglExpr:
    """Generate into variable `name`. Unset arguments take the defaults given to run()."""
    if choices:
        return SglSelect(name, choices, 0.0 if temperature is None else temperature,
                         token_length_normalized if choices_method is None else choices_method)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen(regex=...) is not a valid regular expression: {e}") from None
    return SglGen(name, SglSamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex, json_schema=json_schema,
    ))


def gen_int(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    n: Optional[int] = None,
    stop: Optional[Union[str, list[str]]] = None,
    stop_token_ids: Optional[list[int]] = None,
    stop_regex: Optional[Union[str, list[str]]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: Optional[bool] = None,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: Optional[bool] = None,
) -> SglExpr:
    """gen(dtype=int)."""
    return gen(name, max_tokens, None, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p,
               frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len, top_logprobs_num,
               return_text_in_logprobs, dtype=int)


def gen_string(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    n: Optional[int] = None,
    stop: Optional[Union[str, list[str]]] = None,
    stop_token_ids: Optional[list[int]] = None,
    stop_regex: Optional[Union[str, list[str]]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: Optional[bool] = None,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: Optional[bool] = None,
) -> SglExpr:
    """gen(dtype=str): a double-quoted string of word characters and spaces."""
    return gen(name, max_tokens, None, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p,
               frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len, top_logprobs_num,
               return_text_in_logprobs, dtype=str)


def select(
    name: Optional[str] = None,
    choices: Optional[list[str]] = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> SglExpr:
    if choices is None:
        raise ValueError("select needs choices=[...]")
    return SglSelect(name, choices, temperature, choices_method)


def _role(role: str, expr: Optional[Union[SglExpr, str]]) -> SglExprList:
    if expr is None:
        return SglExprList([SglRoleBegin(role), SglRoleEnd(role)])
    return SglRoleBegin(role) + expr + SglRoleEnd(role)


def system(expr: Optional[Union[SglExpr, str]] = None) -> SglExprList:
    return _role("system", expr)


def user(expr: Optional[Union[SglExpr, str]] = None) -> SglExprList:
    return _role("user", expr)


def assistant(expr: Optional[Union[SglExpr, str]] = None) -> SglExprList:
    return _role("assistant", expr)


def system_begin() -> SglRoleBegin:
    return SglRoleBegin("system")


def system_end() -> SglRoleEnd:
    return SglRoleEnd("system")


def user_begin() -> SglRoleBegin:
    return SglRoleBegin("user")


def user_end() -> SglRoleEnd:
    return SglRoleEnd("user")


def assistant_begin() -> SglRoleBegin:
    return SglRoleBegin("assistant")


def assistant_end() -> SglRoleEnd:
    return SglRoleEnd("assistant")
