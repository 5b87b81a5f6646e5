"""The interface between the interpreter and whatever serves the model.

RuntimeEndpoint (lang/backend/runtime_endpoint.py) implements it over ZeroMQ or SGLang's HTTP protocol;
tests may implement it in-process. `select` is implemented here once, on top of `prefill`, so every backend
scores choices the same way (see lang/backend/runtime_select.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from sgl_lite.lang.chat_template import ChatTemplate
from sgl_lite.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from sgl_lite.lang.ir import SglSamplingParams


@dataclass
class PrefillRequest:
    """A prefill-only request (max_new_tokens=0): a prefix-cache hint, or a scoring pass.

    Exactly one of text / input_ids. With return_logprob, the reply's meta_info holds
    input_token_logprobs for prompt positions logprob_start_len.. as [logprob, token_id, None]
    entries, the entry of position 0 having logprob None.
    """

    text: Optional[str] = None
    input_ids: Optional[list[int]] = None
    return_logprob: bool = False
    logprob_start_len: int = -1


class BaseBackend(ABC):
    """Contract for a frontend backend. Methods are called from many program worker threads at once."""

    @abstractmethod
    def get_chat_template(self) -> ChatTemplate:
        """Role prefixes/suffixes for the served model."""

    @abstractmethod
    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        """Complete `text`; return (completion, meta_info) with at least prompt_tokens, completion_tokens,
        cached_tokens and finish_reason in meta_info."""

    @abstractmethod
    def generate_stream(self, text: str, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Like generate, yielding (new text, meta_info) pieces whose texts join to the completion; the last
        piece carries the final meta_info."""

    @abstractmethod
    def prefill(self, requests: list[PrefillRequest]) -> list[dict[str, Any]]:
        """Run prefill-only requests (concurrently, so the runtime may batch them); meta_info per request, in order."""

    @abstractmethod
    def flush_cache(self) -> bool:
        """Drop the runtime's prefix cache; True when it was flushed."""

    @abstractmethod
    def get_server_info(self) -> dict[str, Any]:
        """The runtime's server info (model info, scheduler stats, server args)."""

    def cache_prefix(self, prefix: str) -> None:
        """Prefill `prefix` so that requests starting with it hit the prefix cache."""
        if prefix:
            self.prefill([PrefillRequest(text=prefix)])

    def select(
        self, text: str, choices: list[str], temperature: float, choices_method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        from sgl_lite.lang.backend.runtime_select import select_choice

        return select_choice(self, text, choices, temperature, choices_method)
