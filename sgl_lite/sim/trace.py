"""What the simulator replays: sessions with an arrival time and a priority.

Two sources:
- the benchmark generators (sgl_lite.bench.workloads: multiturn-agent, shared-prefix, random), with
  Poisson session arrivals (or all at 0) exactly like the load driver; turn t+1 arrives when turn t
  finishes, its prompt = prompt + the simulated output + the session's next appendix;
- a JSONL trace, one single-turn request per line:
    {"arrival": 0.5, "prompt": [ids...], "output_len": 32, "priority": 0}
  or, instead of "prompt", a shared prefix by group id plus a private suffix, both drawn from
  seeded random tokens (same group => same prefix tokens):
    {"arrival": 0.5, "prefix_group": 3, "prefix_len": 512, "suffix_len": 64, "output_len": 32}
  "priority" is optional (default 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sgl_lite.bench.workloads import Vocabulary, Workload

# SmolLM2's vocabulary; its special tokens (<|endoftext|>, <|im_start|>, <|im_end|>) are never drawn.
DEFAULT_VOCAB = Vocabulary(49152, frozenset({0, 1, 2}))


@dataclass(frozen=True)
class SimSession:
    session_id: int
    arrival: float
    first_prompt: list[int]
    appendices: list[list[int]] = field(default_factory=list)
    output_len: int = 32
    priority: int = 0

    @property
    def num_turns(self) -> int:
        return len(self.appendices) + 1


def session_arrivals(num_sessions: int, request_rate: float, seed: int) -> list[float]:
    """The load driver's arrival process: all at 0 (rate inf) or Poisson with `request_rate` per second."""
    if math.isinf(request_rate):
        return [0.0] * num_sessions
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_sessions)
    return np.concatenate([[0.0], np.cumsum(gaps)[:-1]]).tolist() if num_sessions else []


def from_workload(workload: Workload, request_rate: float, seed: int, priorities: tuple[int, ...] = (0,)) -> list[SimSession]:
    """Sessions of a bench workload; each session draws its priority uniformly from `priorities` (seeded)."""
    arrivals = session_arrivals(len(workload.sessions), request_rate, seed)
    rng = np.random.default_rng(seed + 1)
    return [SimSession(s.session_id, t, list(s.first_prompt), [list(a) for a in s.appendices], s.output_len,
                       int(priorities[int(rng.integers(len(priorities)))]))
            for s, t in zip(workload.sessions, arrivals)]


def load_trace(path: str | Path, vocab: Vocabulary = DEFAULT_VOCAB, seed: int = 1) -> list[SimSession]:
    """Parse a JSONL trace; ValueError names the line and the field that is wrong."""
    ids = vocab.allowed_ids()
    group_rng_seed = seed * 1_000_003
    prefixes: dict[int, list[int]] = {}
    suffix_rng = np.random.default_rng(seed)
    sessions = []
    lines = Path(path).read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object")
        arrival = _number(row, "arrival", where, minimum=0.0)
        output_len = int(_number(row, "output_len", where, minimum=1))
        priority = int(_number(row, "priority", where, default=0))
        if "prompt" in row:
            prompt = row["prompt"]
            if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and 0 <= t < vocab.size for t in prompt):
                raise ValueError(f"{where}: 'prompt' must be a non-empty list of token ids below {vocab.size}")
        elif "prefix_group" in row:
            group = int(_number(row, "prefix_group", where, minimum=0))
            prefix_len = int(_number(row, "prefix_len", where, minimum=0))
            suffix_len = int(_number(row, "suffix_len", where, minimum=0, default=0))
            if prefix_len + suffix_len == 0:
                raise ValueError(f"{where}: prefix_len + suffix_len must be positive")
            prefix = prefixes.get(group, [])
            if len(prefix) < prefix_len:
                rng = np.random.default_rng(group_rng_seed + group)
                prefix = prefixes[group] = ids[rng.integers(0, ids.size, size=max(prefix_len, 2 * len(prefix)))].tolist()
            prompt = prefix[:prefix_len] + ids[suffix_rng.integers(0, ids.size, size=suffix_len)].tolist()
        else:
            raise ValueError(f"{where}: needs 'prompt' (token ids) or 'prefix_group' + 'prefix_len'")
        sessions.append(SimSession(len(sessions), arrival, prompt, [], output_len, priority))
    if not sessions:
        raise ValueError(f"{path}: the trace has no request")
    return sessions


def _number(row: dict, name: str, where: str, minimum: float | None = None, default: float | None = None) -> float:
    if name not in row:
        if default is None:
            raise ValueError(f"{where}: missing '{name}'")
        return default
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{where}: '{name}' must be a number{bound}; got {value!r}")
    return value
