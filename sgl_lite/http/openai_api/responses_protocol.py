"""Request shapes of OpenAI's Responses API (`POST /v1/responses`, pydantic), and the chat request each one runs as.

As on the chat routes (request_fields.py): strict types, every top-level field honoured, accepted only at
the value this server can honour (any other value gets a 400 naming the field), or one of OpenAI's routing
and caching hints that change nothing in the answer (`ACCEPTED_AND_IGNORED`); an unknown field gets a 400
naming it. Tools, tool_choice and text.format are OpenAI's Responses shapes; `chat_request` turns them into
the chat completion shapes the chat path runs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sgl_lite.http.openai_api.protocol import (
    MAX_TOOLS,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)
from sgl_lite.http.openai_api.request_fields import OpenAIRequest

# Response ids this server makes are "resp_" + 32 hex digits; a longer one cannot be one of them.
MAX_RESPONSE_ID_CHARS = 128
# OpenAI's bounds on metadata: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Hints to OpenAI's own infrastructure (prompt caching, routing, abuse detection, stream padding): they
# change nothing in the answer, so they are accepted and have no effect here.
ACCEPTED_AND_IGNORED = ("prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
                        "stream_options", "user")

_REFUSED = {"background": "background responses are not supported; leave it false",
            "conversation": "conversation objects are not supported; chain responses with previous_response_id",
            "prompt": "stored prompt templates are not supported"}


class _Shape(BaseModel):
    # Nested OpenAI shapes: fields this server has no use for (a tool's `defer_loading`, ...) are ignored.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


class ResponsesFunctionTool(_Shape):
    """A function tool as the Responses API writes it: flat, without chat's `function` wrapper."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition(name=self.name, description=self.description,
                                                                 parameters=self.parameters, strict=self.strict))


class ResponsesNamedToolChoice(_Shape):
    type: Literal["function"]
    name: str


class TextFormatText(_Shape):
    type: Literal["text"]


class TextFormatJsonObject(_Shape):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Shape):
    type: Literal["json_schema"]
    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema], Field(discriminator="type")]


class ResponsesTextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; another one asks for what no template can say


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=MAX_RESPONSE_ID_CHARS)
    store: bool | None = None  # default true, as OpenAI's
    stream: bool | None = None
    tools: list[ResponsesFunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], ResponsesNamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None  # default true
    text: ResponsesTextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_PAIRS)
    # Accepted at the one value this server honours.
    include: list[str] | None = None  # nothing extra to include: empty
    truncation: Literal["disabled"] | None = None  # a conversation longer than the context gets a 400
    background: bool | None = None  # false
    top_logprobs: Literal[0] | None = None
    max_tool_calls: int | None = Field(default=None, ge=0)  # built-in tools only, and this server has none
    service_tier: Literal["auto", "default"] | None = None
    reasoning: dict[str, Any] | None = None  # effort: the chat template's reasoning_effort; no summaries
    conversation: Any = None  # null: conversations are kept by previous_response_id
    prompt: Any = None  # null: no stored prompt templates
    # Accepted and ignored (ACCEPTED_AND_IGNORED).
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("background", "conversation", "prompt")
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        if value:
            raise ValueError(_REFUSED[info.field_name])
        return value

    @field_validator("include")
    @classmethod
    def _nothing_to_include(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(f"this server has no extra output to include ({value[0]!r}); leave it empty")
        return value

    @field_validator("reasoning")
    @classmethod
    def _reasoning_effort_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, setting in (value or {}).items():
            if key == "effort" and not isinstance(setting, (str, type(None))):
                raise ValueError(f"effort must be a string; got {type(setting).__name__}")
            if key != "effort" and setting is not None:
                raise ValueError(f"{key}: reasoning summaries are not produced by this server; leave it null "
                                 "(effort is passed to the chat template as reasoning_effort)")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                                 f"{MAX_METADATA_VALUE_CHARS}")
        return value

    @property
    def stores(self) -> bool:
        return self.store is not False

    def format_config(self) -> dict[str, Any]:
        """text.format as the response echoes it."""
        fmt = self.text.format if self.text is not None else None
        return fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}

    def chat_request(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat completion request that generates this response for `messages` (its whole conversation)."""
        choice: Any = self.tool_choice
        if isinstance(choice, ResponsesNamedToolChoice):
            choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            tools=[tool.chat_tool() for tool in self.tools] if self.tools else None,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls is not False,
            response_format=self._response_format(),
            reasoning_effort=(self.reasoning or {}).get("effort"),
        )

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or isinstance(fmt, TextFormatText):
            return None
        if isinstance(fmt, TextFormatJsonObject):
            return ResponseFormat(type="json_object")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))
