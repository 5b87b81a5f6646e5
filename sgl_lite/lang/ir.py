"""The frontend's intermediate representation: the expressions a program appends to its state.

Expressions are plain data; the executor (lang/executor.py) gives them meaning. They concatenate
with `+` (and with str on either side) into an SglExprList, as in SGLang, so
`"Q: " + sgl.gen("a") + "\\n"` is one expression appended in order.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any, Optional, Union

from sgl_lite.runtime.protocol import SamplingParams

if TYPE_CHECKING:
    from sgl_lite.lang.choices import ChoicesSamplingMethod
    from sgl_lite.lang.function import SglFunction

# The regexes SGLang maps gen(dtype=...) to. int and float also add " " and "\n" as stop strings:
# the trailing [ \n]* lets the model end the number, the stop strings cut that whitespace off.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_node_ids = itertools.count()


@dataclasses.dataclass
class SglSamplingParams:
    """Sampling parameters of one gen call, or the program-wide defaults given to run().

    In a gen call every field left None means "use the program default"; `resolve` merges.
    Field names follow SGLang's frontend; `to_runtime_params` maps them to the wire's SamplingParams (the
    one mapping from the DSL to the runtime).
    """

    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    n: Optional[int] = None
    stop: Union[str, list[str], tuple, None] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Union[str, list[str], None] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    dtype: Union[type, str, None] = None
    regex: Optional[str] = None
    json_schema: Union[str, dict, None] = None
    # sgl_lite addition: the request priority, passed through to the runtime's scheduler.
    priority: Optional[int] = None

    def resolve(self, defaults: SglSamplingParams) -> SglSamplingParams:
        """Return defaults overridden by every field of self that is not None (self, defaults untouched)."""
        merged = dataclasses.replace(defaults)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                setattr(merged, f.name, value)
        return merged

    def stop_list(self) -> list[str]:
        if not self.stop:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_supported(self) -> None:
        """Raise ValueError for SGLang options sgl_lite does not implement."""
        if self.n not in (None, 1):
            raise ValueError(f"gen(n=...) is not supported by sgl_lite (only n=1); got n={self.n}")

    def to_runtime_params(self) -> SamplingParams:
        """The wire's SamplingParams: dtype turned into its regex, fields left None take the runtime's defaults."""
        self.check_supported()
        stop = self.stop_list()
        regex = self.regex
        if self.dtype is not None:
            regex, extra_stop = dtype_to_regex(self.dtype)
            stop += extra_stop
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "stop": stop or None,
            "stop_token_ids": list(self.stop_token_ids) if self.stop_token_ids else None,
            "stop_regex": self.stop_regex or None,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
            "regex": regex,
            "json_schema": self.json_schema,
        }
        return SamplingParams(**{k: v for k, v in params.items() if v is not None})

    def request_options(self) -> dict[str, Any]:
        """The request's own fields beside its sampling params (logprobs, priority), under the names both
        the wire's GenerateReq and SGLang's /generate body give them; only those that were set."""
        options: dict[str, Any] = {}
        if self.return_logprob:
            options["return_logprob"] = True
            if self.logprob_start_len is not None:
                options["logprob_start_len"] = self.logprob_start_len
            if self.top_logprobs_num is not None:
                options["top_logprobs_num"] = self.top_logprobs_num
        if self.priority is not None:
            options["priority"] = self.priority
        return options


def dtype_to_regex(dtype: Union[type, str]) -> tuple[str, list[str]]:
    """(regex, extra stop strings) for gen(dtype=...), exactly as SGLang's runtime endpoint maps them."""
    if dtype in (int, "int"):
        return REGEX_INT, [" ", "\n"]
    if dtype in (float, "float"):
        return REGEX_FLOAT, [" ", "\n"]
    if dtype in (str, "str"):
        return REGEX_STR, []
    if dtype in (bool, "bool"):
        return REGEX_BOOL, []
    raise ValueError(f"gen(dtype=...) must be int, float, str or bool; got {dtype!r}")


class SglExpr:
    """Base of all expressions. `a + b` builds an SglExprList (strings become SglConstantText)."""

    def __init__(self) -> None:
        self.node_id = next(_node_ids)

    def __add__(self, other: Union[SglExpr, str]) -> SglExprList:
        return _concat(self, _as_expr(other))

    def __radd__(self, other: Union[SglExpr, str]) -> SglExprList:
        return _concat(_as_expr(other), self)


def _as_expr(value: Union[SglExpr, str]) -> SglExpr:
    if isinstance(value, str):
        return SglConstantText(value)
    if not isinstance(value, SglExpr):
        raise TypeError(f"cannot append {type(value).__name__} to a program; expected str or an sgl expression")
    return value


def _concat(a: SglExpr, b: SglExpr) -> SglExprList:
    left = a.expr_list if isinstance(a, SglExprList) else [a]
    right = b.expr_list if isinstance(b, SglExprList) else [b]
    return SglExprList(left + right)


class SglExprList(SglExpr):
    def __init__(self, expr_list: list[SglExpr]) -> None:
        super().__init__()
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglGen(SglExpr):
    """Generate text into variable `name` (None: append without storing)."""

    def __init__(self, name: Optional[str], sampling_params: SglSamplingParams) -> None:
        super().__init__()
        self.name = name
        self.sampling_params = sampling_params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    """Append the choice the model scores best; store it into variable `name`."""

    def __init__(
        self, name: Optional[str], choices: list[str], temperature: float, choices_method: ChoicesSamplingMethod
    ) -> None:
        super().__init__()
        if not choices:
            raise ValueError("select needs a non-empty list of choices")
        self.name = name
        self.choices = [str(c) for c in choices]
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class SglCommitLazy(SglExpr):
    """Prefill the state's current text on the runtime (a prefix-cache hint; appends nothing)."""


class SglFunctionCall(SglExpr):
    """`other(...)` written inside a running program: `s += other(...)` runs other's body on s."""

    def __init__(self, function: SglFunction, args: tuple, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.function = function
        self.args = args
        self.kwargs = kwargs


def variable_names(expr: SglExpr) -> list[str]:
    """Names of the variables an expression will set (for their wait events)."""
    if isinstance(expr, (SglGen, SglSelect)):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, SglVarScopeBegin):
        return [expr.name]
    if isinstance(expr, SglExprList):
        return [name for e in expr.expr_list for name in variable_names(e)]
    return []
