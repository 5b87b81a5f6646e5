"""`sgl.OpenAI`: run @function programs against any OpenAI-compatible server (sgl_lite's HTTP front,
SGLang, vLLM, ...), as SGLang's OpenAI backend does for completion models.

The program's text (role markers rendered by `chat_template`, ChatML unless given) is sent to
/v1/completions; SGLang's sampling extras (top_k, min_p, regex, json_schema, ...) travel in the body,
where servers that know them apply them. `select` scores each choice by the logprobs of its tokens
(completions with echo=True, logprobs, max_tokens=0); against a server that returns no prompt
logprobs it falls back to greedy generation and picks the choice that output starts with.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional

import msgspec

from sgl_lite.lang.backend.base import BaseBackend, PrefillRequest
from sgl_lite.lang.chat_template import CHATML, ChatTemplate
from sgl_lite.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from sgl_lite.lang.ir import SglSamplingParams

# Runtime (SGLang) sampling keys that OpenAI's API names differently or has as its own.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "stop": "stop", "temperature": "temperature", "top_p": "top_p",
                 "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty"}
_FALLBACK_SELECT_TOKENS = 16


class OpenAI(BaseBackend):
    def __init__(self, model_name: str, base_url: Optional[str] = None, api_key: Optional[str] = None,
                 chat_template: Optional[ChatTemplate] = None, timeout: float = 600.0) -> None:
        try:
            import openai
        except ImportError:
            raise ImportError("sgl.OpenAI needs the `openai` package: pip install openai") from None
        self.model_name = model_name
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                    max_retries=0, timeout=timeout)
        self.chat_template = chat_template or CHATML
        self._bad_request = openai.BadRequestError

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def _request(self, params: SglSamplingParams) -> dict[str, Any]:
        request: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        runtime_params = params.to_runtime_params()
        fields = msgspec.to_builtins(runtime_params)  # the fields that differ from the runtime's defaults
        fields["max_new_tokens"] = runtime_params.max_new_tokens  # OpenAI's default differs: always send it
        for key, value in fields.items():
            if key in _OPENAI_NAMES:
                request[_OPENAI_NAMES[key]] = value
            elif key == "min_new_tokens":
                extra["min_tokens"] = value
            else:
                extra[key] = value
        if self.chat_template.stop_str:
            stops = request.get("stop") or []
            stops = [stops] if isinstance(stops, str) else list(stops)
            request["stop"] = stops + [s for s in self.chat_template.stop_str if s not in stops]
        if extra:
            request["extra_body"] = extra
        return request

    @staticmethod
    def _meta(completion: Any, choice: Any) -> dict[str, Any]:
        usage = completion.usage
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        return {
            "prompt_tokens": usage.prompt_tokens if usage is not None else 0,
            "completion_tokens": usage.completion_tokens if usage is not None else 0,
            "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details is not None else 0,
            "finish_reason": {"type": choice.finish_reason or "stop"},
        }

    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        completion = self.client.completions.create(model=self.model_name, prompt=text, **self._request(params))
        choice = completion.choices[0]
        return choice.text, self._meta(completion, choice)

    def generate_stream(self, text: str, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        stream = self.client.completions.create(model=self.model_name, prompt=text, stream=True,
                                                stream_options={"include_usage": True}, **self._request(params))
        finish = None
        for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                if choice.text:
                    yield choice.text, {}
            if chunk.usage is not None:
                yield "", {"prompt_tokens": chunk.usage.prompt_tokens, "completion_tokens": chunk.usage.completion_tokens,
                           "cached_tokens": 0, "finish_reason": {"type": finish or "stop"}}

    def prefill(self, requests: list[PrefillRequest]) -> list[dict[str, Any]]:
        """Prefix-cache hints: a zero-token completion of each text (ids cannot be sent as text here)."""
        out = []
        for r in requests:
            prompt: Any = r.text if r.text is not None else r.input_ids
            completion = self.client.completions.create(model=self.model_name, prompt=prompt, max_tokens=0)
            out.append(self._meta(completion, completion.choices[0]))
        return out

    def flush_cache(self) -> bool:
        return False  # not part of the OpenAI API

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": self.model_name}

    def select(self, text: str, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        if not choices:
            raise ValueError("select needs a non-empty list of choices")
        if choices_method.requires_unconditional_logprobs:
            raise ValueError("sgl.OpenAI cannot score choices without context (token ids are not exposed); "
                             "use token_length_normalized or greedy_token_selection")
        try:
            scored = [self._choice_logprobs(text, choice) for choice in choices]
        except self._bad_request:
            scored = None
        if scored is None or any(not entries for entries in scored):
            return self._select_by_generation(text, choices)
        normalized = [sum(e[0] for e in entries) / len(entries) for entries in scored]
        return choices_method(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=scored,
                              output_token_logprobs=[[] for _ in choices], unconditional_token_logprobs=None)

    def _choice_logprobs(self, text: str, choice: str) -> list[list[Any]]:
        """[logprob, token, None] for the tokens that hold the choice's text (a token merging it with the
        text before counts as the choice's), read from the end of the echoed prompt."""
        completion = self.client.completions.create(model=self.model_name, prompt=text + choice, max_tokens=0,
                                                    echo=True, logprobs=0)
        logprobs = completion.choices[0].logprobs
        if logprobs is None or not logprobs.tokens:
            return []
        entries: list[list[Any]] = []
        covered = 0
        for token, logprob in zip(reversed(logprobs.tokens), reversed(logprobs.token_logprobs)):
            if covered >= len(choice) or logprob is None:
                break
            entries.insert(0, [float(logprob), token, None])
            covered += len(token)
        return entries

    def _select_by_generation(self, text: str, choices: list[str]) -> ChoicesDecision:
        completion = self.client.completions.create(model=self.model_name, prompt=text,
                                                    max_tokens=_FALLBACK_SELECT_TOKENS, temperature=0)
        output = completion.choices[0].text

        def shared(choice: str) -> int:
            n = 0
            while n < min(len(choice), len(output)) and choice[n] == output[n]:
                n += 1
            return n

        best = max(range(len(choices)), key=lambda i: (shared(choices[i]), -i))
        return ChoicesDecision(decision=choices[best], meta_info={"fallback": "generation", "output": output})
