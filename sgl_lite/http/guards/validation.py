"""Pydantic validation errors -> one 400 HttpError naming the first offending field.

FastAPI answers 422 with a list of errors; OpenAI clients expect 400 with one message and `param`.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError

from sgl_lite.http.errors import HttpError

# Parts of a pydantic error location that name a union member or a validator, not a field.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "function-before",
              "function-wrap", "literal", "json-or-python", "tagged-union"}


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in str(part) or str(part).lower() in _TYPE_TAGS:
            break  # the rest describes which union member failed
        elif _is_model_name(str(part)):
            continue  # a union's model member (SessionParams): its fields follow
        else:
            path += ("." if path else "") + str(part)
    return path


def _is_model_name(part: str) -> bool:
    return part.isidentifier() and part[0].isupper() and "_" not in part and not part.isupper()


def validation_error(exc: RequestValidationError) -> HttpError:
    errors = exc.errors()
    if not errors:
        return HttpError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = str(first.get("ctx", {}).get("error", first.get("msg")))
        if "hex escape" in detail and "surrogate" not in detail:  # pydantic's words for a lone high surrogate
            detail += " (a lone surrogate: \\uD800-\\uDFFF must come in pairs)"
        return HttpError(400, f"request body is not valid JSON: {detail}", code="invalid_json")
    field = _field_path(tuple(first.get("loc", ())))
    if not field:
        return HttpError(400, f"request body: {first.get('msg')}", code="invalid_request")
    message = f"{field}: {first.get('msg')}"
    if first.get("type") == "extra_forbidden":
        message = f"{field}: unknown field"
    return HttpError(400, message, param=field, code="invalid_value")
