"""Request shapes of the OpenAI-compatible API (pydantic) and their mapping to runtime SamplingParams.

Field names, types and defaults follow OpenAI's API; SGLang's extra sampling fields (priority,
ignore_eos, min_tokens, regex, ebnf, top_k, min_p, repetition_penalty, stop_token_ids, ...) are
accepted as well, as SGLang's own server does. Types are strict ("1" is not a token id, "yes" not a
bool). Every top-level field is honoured, or accepted and ignored where it cannot change the result
(request_fields.py), or accepted only at its off value (refused with the reason otherwise); any
other field is refused. Nested objects (messages, tools) ignore keys this server
does not read, as clients echo back fields of earlier responses. docs/http.md has the lists.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sgl_lite.http.chat_template import RESERVED_TEMPLATE_VARIABLES, RenderOptions
from sgl_lite.http.openai_api.request_fields import OpenAIRequest
from sgl_lite.runtime.protocol import MAX_RID_CHARS, MAX_STOP_TOKEN_IDS

# The largest n (choices per prompt) one request may ask for: each choice is one runtime request.
MAX_CHOICES = 64
MAX_TOP_LOGPROBS = 20
# OpenAI's own limit on the tools of one request.
MAX_TOOLS = 128


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(OpenAIRequest):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's, then SGLang's extras)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # SGLang's extras.
    priority: int | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    regex: str | None = None
    ebnf: str | None = None
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_regex: Union[str, list[str], None] = None
    # Refused unless off (request_fields.UNSERVED_FIELDS).
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = False

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be -1 (off) or >= 1")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, choice_index: int) -> dict[str, Any]:
        """Runtime sampling params (SGLang names) for choice `choice_index` of this request.

        With a seed and n > 1, choice i uses seed + i so that the choices differ but stay reproducible.
        """
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
        }
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        for name in ("stop", "stop_token_ids", "stop_regex", "logit_bias", "regex", "ebnf"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        if self.seed is not None:
            params["seed"] = self.seed + choice_index
        json_schema = self.json_schema()
        if json_schema is not None:
            params["json_schema"] = json_schema
        return params

    def json_schema(self) -> dict[str, Any] | None:
        """The JSON Schema that response_format asks for; json_object means any JSON object."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "object"}
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValueError("response_format.json_schema.schema is required when response_format.type is json_schema")
        return fmt.json_schema.schema_

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, message) for a field given a value this server cannot honour, else None (UNSERVED_FIELDS
        are refused while the body is parsed)."""
        return None


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None means no arguments
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Lenient):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # a chat completion writes at least one token
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    # How the chat template renders (transformers' apply_chat_template arguments; vLLM's and SGLang's fields).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the chat template as the variable reasoning_effort, as SGLang does (templates that read it).
    reasoning_effort: Union[str, float, None] = None
    # SGLang's: split the reasoning into reasoning_content, streamed as it comes (with --reasoning-parser).
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # Accepted and ignored (request_fields.IGNORED_FIELDS).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Refused unless off (request_fields.UNSERVED_FIELDS).
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None
    moderation: Any = None

    def render_options(self) -> RenderOptions:
        """How the chat template renders this request: continue_final_message without an explicit
        add_generation_prompt turns the generation prompt off (giving both true is refused)."""
        add_generation_prompt = self.add_generation_prompt
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            add_generation_prompt = False
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
        return RenderOptions(add_generation_prompt, self.continue_final_message, variables or None)

    def requested_max_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens in favour of max_completion_tokens; the newer one wins.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            return "continue_final_message", ("continue_final_message and add_generation_prompt are not compatible: the "
                                              "first continues the final message, the second starts a new one")
        clash = sorted(RESERVED_TEMPLATE_VARIABLES & (self.chat_template_kwargs or {}).keys())
        if clash:
            return "chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(clash)} (the request's own fields do)"
        return super().unsupported_field()

    def top_logprobs_num(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix (fill-in-the-middle) is not supported by this server"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported by this server"
        if self.echo and self.logprobs is not None and self.stream:
            return "echo", "echo together with logprobs is supported without stream only"
        if self.echo and not self.prompt_texts_known():
            return "echo", "echo is supported for text prompts only"
        return super().unsupported_field()

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """Each prompt as (text, None) or (None, token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [(prompt, None)]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, str) for p in prompt):
            return [(p, None) for p in prompt]  # type: ignore[misc]
        if all(isinstance(p, int) for p in prompt):
            return [(None, list(prompt))]  # type: ignore[arg-type]
        return [(None, list(p)) for p in prompt]  # type: ignore[arg-type, union-attr]

    def prompt_texts_known(self) -> bool:
        return isinstance(self.prompt, str) or all(isinstance(p, str) for p in self.prompt)


class AbortRequest(BaseModel):
    """SGLang's /abort_request body: one request by its rid, or all of them."""

    model_config = ConfigDict(extra="forbid")
    rid: str = Field(default="", max_length=MAX_RID_CHARS)
    abort_all: bool = False
