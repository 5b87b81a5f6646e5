"""OpenAI's error shape {"error": {"message", "type", "param", "code"}} and the mapping of runtime
errors onto HTTP statuses.

Status rules: 400 for a bad field (named in the message and in `param`), 401 for a missing or wrong
API key, 503 when the runtime's queue is full (code queue_full), 500 when the runtime is unreachable
or a request was aborted by the runtime.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from sgl_lite.runtime.client import RuntimeRequestError, RuntimeUnavailableError

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    499: "invalid_request_error",
    503: "service_unavailable",
}

# RuntimeRequestError codes (protocol.ErrorReply.code) -> HTTP status.
_STATUS_BY_RUNTIME_CODE = {
    "bad_request": 400,
    "unauthorized": 500,  # the front's own runtime key is wrong: a deployment fault, not the caller's
    "queue_full": 503,
    "aborted": 500,
    "internal": 500,
}


class HttpError(Exception):
    """An error to answer with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def outcome(self) -> str:
        """The metrics label for this failure."""
        if self.code in ("queue_full", "aborted", "runtime_unavailable", "cancelled"):
            return self.code
        return {400: "bad_request", 401: "unauthorized", 404: "not_found"}.get(self.status, "error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPE_BY_STATUS.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, param=param, code="invalid_value" if param else None)


def from_runtime_error(exc: Exception) -> HttpError:
    """Map a RuntimeClient exception onto an HttpError; anything else is a 500 with its message."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, RuntimeRequestError):
        status = _STATUS_BY_RUNTIME_CODE.get(exc.code, 500)
        param = _param_named_in(exc.message) if status == 400 else None
        return HttpError(status, exc.message, param=param, code=exc.code)
    if isinstance(exc, RuntimeUnavailableError):
        return HttpError(500, f"the runtime is unavailable: {exc}", code="runtime_unavailable")
    return HttpError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal")


# Request fields a runtime message may name, the ones a caller most likely has to change first.
_RUNTIME_FIELDS = ("max_new_tokens", "min_new_tokens", "json_schema", "structural_tag", "regex", "ebnf", "stop_token_ids",
                   "stop_regex", "logit_bias", "stream_interval",
                   "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty", "seed", "priority", "logprob_start_len", "top_logprobs_num",
                   "input_ids", "prompt", "text")


def _param_named_in(message: str) -> str | None:
    """The request field a runtime validation message names ("invalid regex: ...", "top_p must ..."), if any."""
    words = set(message.replace(":", " ").replace("(", " ").replace(",", " ").split())
    return next((field for field in _RUNTIME_FIELDS if field in words), None)
