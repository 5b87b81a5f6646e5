"""Which top-level fields the OpenAI routes take, and what becomes of each one that is not honoured.

A body field is honoured (the request models of protocol.py read it), accepted and ignored where it
cannot change the result (IGNORED_FIELDS, with why), accepted only at its off value and refused with
the reason otherwise (UNSERVED_FIELDS), or unknown and refused. `OpenAIRequest` is the base of the
routes' request models: unknown fields refused, strict types ("1" is not a token id, "yes" not a
bool), UNSERVED_FIELDS checked. docs/http.md has the same lists.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

# Fields accepted and ignored: they cannot change the result here (why, per field).
IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user id for the caller's own abuse tracking",
    "metadata": "tags for stored completions, which are not kept",
    "store": "completions are not stored",
    "service_tier": "one tier",
    "safety_identifier": "an end-user id for the caller's own abuse tracking",
    "prompt_cache_key": "the prefix cache matches every request's prompt by itself",
    "prompt_cache_retention": "the prefix cache keeps prompts while its memory allows",
    "prompt_cache_options": "the prefix cache matches every request's prompt by itself",
}
# Fields accepted only at their off value (null, false, empty; modalities also ["text"]); the reason they are
# refused otherwise.
UNSERVED_FIELDS: dict[str, str] = {
    "lora_path": "LoRA adapters are not supported by this server",
    "session_params": "SGLang sessions are not supported by this server",
    "custom_logit_processor": "custom logit processors are not run by this server",
    "return_hidden_states": "hidden states are not returned by this server",
    "audio": "audio output is not supported by this server",
    "modalities": "only text output is supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "functions": "the deprecated functions field is not supported; use tools",
    "function_call": "the deprecated function_call field is not supported; use tool_choice",
    "verbosity": "verbosity is not supported by this server",
    "moderation": "moderation is not supported by this server",
}


class OpenAIRequest(BaseModel):
    """A route's body: strict types, and every top-level field declared (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    @field_validator(*UNSERVED_FIELDS, check_fields=False)
    @classmethod
    def _unserved_off(cls, value: Any, info: Any) -> Any:
        if value not in (None, False, "", [], {}) and not (info.field_name == "modalities" and value == ["text"]):
            raise ValueError(UNSERVED_FIELDS[info.field_name])
        return value
