"""What the HTTP front needs to know about the served model, fetched once from the runtime's server_info.

Fetched lazily (the HTTP front may start before the runtime is ready) and then kept: the model,
its chat template and its vocabulary do not change while a runtime runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import anyio

from sgl_lite.http.chat_template import ChatTemplate, ChatTemplateError
from sgl_lite.http.errors import HttpError, from_runtime_error
from sgl_lite.http.guards.prompt_budget import BatchTokenLimit, PromptBudget
from sgl_lite.http.token_text import TokenTexts
from sgl_lite.lang.chat_template import token_text


@dataclass
class ModelContext:
    served_model_name: str
    context_length: int | None
    chat_template: ChatTemplate | None
    chat_template_error: str | None  # why chat_template is None
    token_texts: TokenTexts
    model_info: dict[str, Any]
    tool_call_parser: str | None = None  # the runtime's --tool-call-parser
    reasoning_parser: str | None = None  # the runtime's --reasoning-parser
    constrain_tool_calls: bool = True  # not --disable-tool-call-constraint
    # The runtime's bound on a token's characters (it refuses longer texts before tokenizing them).
    max_token_chars: int | None = None
    split_special_tokens_in_messages: bool = True  # --split-special-tokens-in-messages
    reuse_answer_ids: bool = True  # --reuse-answer-ids

    @classmethod
    def from_server_info(cls, info: dict[str, Any], served_model_name: str | None) -> ModelContext:
        model_path = info.get("model_path")
        server_args = info.get("server_args") or {}
        name = served_model_name or info.get("served_model_name") or (Path(model_path).name if model_path else "default")
        template: ChatTemplate | None = None
        error: str | None = None
        try:
            template = ChatTemplate(info.get("chat_template"), token_text(info.get("bos_token")),
                                    token_text(info.get("eos_token")))
        except ChatTemplateError as e:
            error = str(e)
        return cls(
            served_model_name=str(name),
            context_length=info.get("context_length"),
            chat_template=template,
            chat_template_error=error,
            token_texts=TokenTexts(server_args.get("tokenizer_path") or model_path),
            model_info=info,
            tool_call_parser=server_args.get("tool_call_parser"),
            reasoning_parser=server_args.get("reasoning_parser"),
            constrain_tool_calls=not server_args.get("disable_tool_call_constraint", False),
            max_token_chars=info.get("max_token_chars"),
            split_special_tokens_in_messages=server_args.get("split_special_tokens_in_messages", True),
            reuse_answer_ids=server_args.get("reuse_answer_ids", True),
        )

    @property
    def budget(self) -> PromptBudget:
        """The prompt budget of this model (guards/prompt_budget.py): the runtime's own bound on a token's
        characters, else this front's tokenizer's; the bound on one request's prompts together from its flags."""
        return PromptBudget(self.context_length, self.max_token_chars or self.token_texts.max_token_chars,
                            BatchTokenLimit.of_server(self.model_info.get("server_args") or {}, self.context_length))

    @property
    def logs_requests(self) -> bool:
        """The runtime writes each finished request's text to its log (its --log-requests)."""
        return bool((self.model_info.get("server_args") or {}).get("log_requests"))

    def check_model(self, name: str | None, *, required: bool = False) -> None:
        """vLLM's rule: a request that names a model must name the served one (none named: the served one,
        unless `required`); HttpError 404 with vLLM's message otherwise."""
        if (name or required) and name != self.served_model_name:
            raise HttpError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def model_card(self) -> dict[str, Any]:
        """The served model as /v1/models lists it."""
        return {"id": self.served_model_name, "object": "model", "created": 0, "owned_by": "sgl_lite",
                "root": self.model_info.get("model_path"), "max_model_len": self.context_length}

    def require_chat_template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise HttpError(400, self.chat_template_error or "the model has no chat template", param="messages")
        return self.chat_template


class ModelContextCache:
    def __init__(self, server_info: Callable[[], dict[str, Any]], served_model_name: str | None) -> None:
        self._server_info = server_info
        self._served_model_name = served_model_name
        self._context: ModelContext | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> ModelContext:
        if self._context is None:
            async with self._lock:
                if self._context is None:
                    try:
                        # Off the event loop: server_info is a blocking call and the tokenizer file is parsed.
                        self._context = await anyio.to_thread.run_sync(self._fetch)
                    except Exception as e:
                        raise from_runtime_error(e) from e
        return self._context

    def _fetch(self) -> ModelContext:
        return ModelContext.from_server_info(self._server_info(), self._served_model_name)
