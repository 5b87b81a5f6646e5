"""Scoring `select` choices with prefill-only requests, as SGLang's runtime endpoint does.

1. Prefill the program text alone: the prefix-cache hint, and its token count P.
2. In one concurrent batch, prefill the text alone and text + each choice with input logprobs from
   position P-1 on. The text-alone reply names the text's last token; a choice whose token at P-1
   is that same token did not merge with the text, so that entry is dropped and the rest are the
   choice's own tokens. When the tokenizer merged the boundary (token healing), the merged token
   is kept as part of the choice.
3. For methods that need it, score each choice's tokens again with no context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl_lite.lang.choices import ChoicesDecision, ChoicesSamplingMethod

if TYPE_CHECKING:
    from sgl_lite.lang.backend.base import BaseBackend


def normalized_logprob(entries: list[list[Any]]) -> float:
    """Mean logprob over entries, skipping the context-free first position (None)."""
    values = [float(e[0]) for e in entries if e[0] is not None]
    if not values:
        raise ValueError("a select choice has no scored tokens")
    return sum(values) / len(values)


def select_choice(
    backend: BaseBackend, text: str, choices: list[str], temperature: float, method: ChoicesSamplingMethod
) -> ChoicesDecision:
    from sgl_lite.lang.backend.base import PrefillRequest

    if temperature > 1e-5:
        raise ValueError(f"select supports only temperature 0 (greedy scoring); got {temperature}")
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    prefix_len = backend.prefill([PrefillRequest(text=text)])[0]["prompt_tokens"] if text else 0
    start = max(prefix_len - 1, 0)
    scoring = [PrefillRequest(text=text + c, return_logprob=True, logprob_start_len=start) for c in choices]
    if prefix_len > 0:
        scoring.insert(0, PrefillRequest(text=text, return_logprob=True, logprob_start_len=start))
    replies = backend.prefill(scoring)
    last_prefix_token = replies.pop(0)["input_token_logprobs"][0][1] if prefix_len > 0 else None

    input_token_logprobs = []
    for choice, meta in zip(choices, replies):
        entries = [list(e) for e in meta["input_token_logprobs"]]
        if prefix_len > 0 and entries and entries[0][1] == last_prefix_token:
            entries = entries[1:]
        if not entries:
            raise ValueError(f"select choice {choice!r} adds no tokens to the prompt")
        input_token_logprobs.append(entries)
    output_token_logprobs = [meta.get("output_token_logprobs", []) for meta in replies]
    normalized = [normalized_logprob(entries) for entries in input_token_logprobs]

    unconditional = None
    if method.requires_unconditional_logprobs:
        requests = [PrefillRequest(input_ids=[int(e[1]) for e in entries], return_logprob=True, logprob_start_len=0)
                    for entries in input_token_logprobs]
        unconditional = [meta["input_token_logprobs"] for meta in backend.prefill(requests)]
    return method(
        choices=choices,
        normalized_prompt_logprobs=normalized,
        input_token_logprobs=input_token_logprobs,
        output_token_logprobs=output_token_logprobs,
        unconditional_token_logprobs=unconditional,
    )
