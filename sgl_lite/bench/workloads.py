"""Benchmark workloads: seeded random token ids, no data set, reproducible run to run.

A workload is a list of sessions. A session is a chain of turns: turn 0 sends `first_prompt`; turn
t+1 is sent only after turn t finished, and its prompt is turn t's prompt + the output ids the
system actually returned + `appendices[t]` (a tool observation, say), kept in those pieces for
backends that send a conversation as chat messages. Single-turn workloads
(shared-prefix, random) are sessions of one turn. Everything random is drawn at construction time
from one seed, so two systems serving the same workload see the same text wherever their outputs
agree (and greedy decoding with ignore_eos makes the outputs agree up to numerics).

Prompts are token ids drawn uniformly from the vocabulary minus its special tokens; they are sent
as input_ids, so tokenization can never blur the shared prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

WORKLOAD_NAMES = ("multiturn-agent", "shared-prefix", "random")


@dataclass(frozen=True)
class Vocabulary:
    """The ids prompts are drawn from: [0, size) minus `excluded_ids` (special tokens)."""

    size: int
    excluded_ids: frozenset[int] = frozenset()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, model_vocab_size: int | None = None) -> Vocabulary:
        """Ids beyond the tokenizer's length (padded embedding rows) are never drawn."""
        size = len(tokenizer)
        if model_vocab_size is not None:
            size = min(size, model_vocab_size)
        return cls(size, frozenset(int(i) for i in tokenizer.all_special_ids))

    def allowed_ids(self) -> np.ndarray:
        ids = np.arange(self.size, dtype=np.int64)
        if self.excluded_ids:
            ids = ids[~np.isin(ids, np.fromiter(self.excluded_ids, dtype=np.int64))]
        if ids.size == 0:
            raise ValueError(f"vocabulary of size {self.size} has no non-special token to draw prompts from")
        return ids


class TokenSampler:
    """Uniform draws of token ids from a vocabulary, from one seeded generator."""

    def __init__(self, vocab: Vocabulary, seed: int) -> None:
        self._ids = vocab.allowed_ids()
        self._rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> list[int]:
        return self._ids[self._rng.integers(0, self._ids.size, size=n)].tolist()

    def length(self, low: int, high: int) -> int:
        """A length uniform in [low, high]."""
        return int(self._rng.integers(low, high + 1))


@dataclass(frozen=True)
class Session:
    """One conversation. Invariant: len(appendices) == num_turns - 1."""

    session_id: int
    first_prompt: list[int]
    appendices: list[list[int]]
    output_len: int
    group: int = 0  # shared-prefix group (0 elsewhere), for the report

    @property
    def num_turns(self) -> int:
        return len(self.appendices) + 1

    def next_pieces(self, turn: int, pieces: Sequence[list[int]], output_ids: Sequence[int]) -> list[list[int]]:
        """The prompt of turn `turn + 1` in pieces, given turn `turn`'s pieces and actual output: the first
        prompt, then each turn's output and appendix (joined, the prompt; as chat messages, the user's and
        the model's turns in turn)."""
        if not 0 <= turn < self.num_turns - 1:
            raise ValueError(f"session {self.session_id} has {self.num_turns} turns; no turn after {turn}")
        return [*pieces, list(output_ids), self.appendices[turn]]


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: list[Session]
    params: dict[str, Any] = field(default_factory=dict)  # the generator's arguments, for the report

    @property
    def num_requests(self) -> int:
        return sum(s.num_turns for s in self.sessions)

    @property
    def max_turns(self) -> int:
        return max((s.num_turns for s in self.sessions), default=0)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive; got {value}")


def multiturn_agent(vocab: Vocabulary, *, num_sessions: int, num_turns: int, system_prompt_len: int,
                    task_len: int, obs_len_min: int, obs_len_max: int, output_len: int, seed: int) -> Workload:
    """N agent sessions x T turns (SGLang's ReAct / multi-turn benchmarks): one system prompt shared by
    all sessions, a task per session, and after each turn the model's answer plus a tool observation
    of random length in [obs_len_min, obs_len_max]."""
    _check_positive(num_sessions=num_sessions, num_turns=num_turns, system_prompt_len=system_prompt_len,
                    task_len=task_len, obs_len_min=obs_len_min, output_len=output_len)
    if obs_len_max < obs_len_min:
        raise ValueError(f"obs_len_max ({obs_len_max}) must be >= obs_len_min ({obs_len_min})")
    sampler = TokenSampler(vocab, seed)
    system_prompt = sampler.tokens(system_prompt_len)
    sessions = []
    for sid in range(num_sessions):
        task = sampler.tokens(task_len)
        observations = [sampler.tokens(sampler.length(obs_len_min, obs_len_max)) for _ in range(num_turns - 1)]
        sessions.append(Session(sid, system_prompt + task, observations, output_len))
    params = dict(num_sessions=num_sessions, num_turns=num_turns, system_prompt_len=system_prompt_len,
                  task_len=task_len, obs_len_min=obs_len_min, obs_len_max=obs_len_max, output_len=output_len, seed=seed)
    return Workload("multiturn-agent", sessions, params)


def shared_prefix(vocab: Vocabulary, *, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                  question_len: int, output_len: int, seed: int) -> Workload:
    """G groups x P prompts: a system prompt per group plus a question (SGLang's generated-shared-prefix).

    Arrival order is shuffled (seeded), as SGLang's generator does, so groups interleave."""
    _check_positive(num_groups=num_groups, prompts_per_group=prompts_per_group,
                    system_prompt_len=system_prompt_len, question_len=question_len, output_len=output_len)
    sampler = TokenSampler(vocab, seed)
    prompts: list[tuple[int, list[int]]] = []
    for g in range(num_groups):
        system_prompt = sampler.tokens(system_prompt_len)
        prompts += [(g, system_prompt + sampler.tokens(question_len)) for _ in range(prompts_per_group)]
    order = np.random.default_rng(seed).permutation(len(prompts))
    sessions = [Session(i, prompts[j][1], [], output_len, group=prompts[j][0]) for i, j in enumerate(order)]
    params = dict(num_groups=num_groups, prompts_per_group=prompts_per_group, system_prompt_len=system_prompt_len,
                  question_len=question_len, output_len=output_len, seed=seed)
    return Workload("shared-prefix", sessions, params)


def random_prompts(vocab: Vocabulary, *, num_prompts: int, input_len: int, output_len: int, seed: int) -> Workload:
    """Independent prompts of `input_len` random tokens: nothing shared beyond chance."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    sampler = TokenSampler(vocab, seed)
    sessions = [Session(i, sampler.tokens(input_len), [], output_len) for i in range(num_prompts)]
    return Workload("random", sessions, dict(num_prompts=num_prompts, input_len=input_len, output_len=output_len, seed=seed))
