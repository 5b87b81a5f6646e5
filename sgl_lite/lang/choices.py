"""How `select` turns per-choice token logprobs into a decision (SGLang's three methods).

Every method receives, per choice, the logprob entries of the choice's tokens in the context of
the program text, each entry `[logprob, token_id, text_or_None]`, and their mean
(`normalized_prompt_logprobs`). Ties go to the first choice.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

LogprobEntries = Sequence[Sequence[Any]]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _first_argmax(values: Sequence[float]) -> int:
    best = 0
    for i, value in enumerate(values):
        if value > values[best]:
            best = i
    return best


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


class ChoicesSamplingMethod(ABC):
    """Contract: pick one of `choices` from their scores; return the pick and the scores used."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        """True when the caller must also score each choice's tokens with no context."""
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[LogprobEntries],
        output_token_logprobs: list[LogprobEntries],
        unconditional_token_logprobs: Optional[list[LogprobEntries]] = None,
    ) -> ChoicesDecision: ...

    def _meta(self, normalized: list[float], inputs: list, outputs: list) -> dict[str, Any]:
        return {"normalized_prompt_logprobs": normalized, "input_token_logprobs": inputs, "output_token_logprobs": outputs}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _first_argmax(normalized_prompt_logprobs)
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoicesDecision(choices[best], meta)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token, keeping those with the highest logprob at each position.

    A shorter choice is padded with its own mean logprob so it can be compared with longer ones.
    """

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(entries) for entries in input_token_logprobs)
        matrix = []
        for entries in input_token_logprobs:
            row = [float(e[0]) for e in entries]
            pad = _mean(row) if row else math.nan
            matrix.append(row + [pad] * (width - len(row)))
        remaining = list(range(len(choices)))
        for col in range(width):
            top = max(matrix[i][col] for i in remaining)
            remaining = [i for i in remaining if matrix[i][col] == top]
            if len(remaining) == 1:
                break
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[remaining[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (logprob in context - logprob without context) per token.

    The first unconditional logprob has no context at all (None); it counts as 0.
    """

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional token logprobs")
        scores = []
        for conditional, unconditional in zip(input_token_logprobs, unconditional_token_logprobs):
            cond = [float(e[0]) for e in conditional]
            uncond = [e[0] for e in unconditional]
            if len(cond) != len(uncond):
                raise ValueError("input and unconditional token logprobs must have the same length")
            uncond[0] = uncond[0] or 0.0
            scores.append(_mean([c - float(u) for c, u in zip(cond, uncond)]))
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[_first_argmax(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
