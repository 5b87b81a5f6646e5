"""Per-request timing records and their statistics: throughput, latency percentiles, cache hit rates.

Latency definitions (all measured by the load driver's clock, `time.perf_counter`):
- TTFT: first chunk carrying an output token minus send time.
- ITL: a chunk carrying k tokens that arrives g seconds after the previous one counts k gaps of g/k
  (the server may coalesce tokens into one chunk; spreading keeps the per-token mean exact). Tokens
  of the first chunk beyond the first have no measurable gap and are not counted.
- e2e: final reply minus send time.

Cache hit rate = sum(cached_tokens) / sum(prompt_tokens), from the runtime's meta_info. The IDEAL
hit rate is computed from the token ids alone: each request, in send order, could at best reuse the
longest prefix of its prompt found in any earlier request's prompt + output (an infinite cache),
capped at len(prompt) - 1 because a runtime must compute at least the last prompt token to get the
next token's logits (sgl_lite's `prefix_match_key` applies the same cap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    session_id: int
    turn: int
    group: int
    prompt_ids: list[int]
    send_time: float
    output_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with >= 1 new token
    chunk_sizes: list[int] = field(default_factory=list)  # new tokens in that chunk
    finish_time: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_time is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.finish_time - self.send_time if self.finish_time is not None else None

    def inter_token_latencies(self) -> list[float]:
        gaps: list[float] = []
        for i in range(1, len(self.chunk_times)):
            size = self.chunk_sizes[i]
            gaps += [(self.chunk_times[i] - self.chunk_times[i - 1]) / size] * size
        return gaps

    def to_json(self) -> dict[str, Any]:
        """Timings and counts, without the token ids (which would dwarf the report)."""
        return {
            "session_id": self.session_id, "turn": self.turn, "group": self.group, "send_time": self.send_time,
            "ttft_ms": _ms(self.ttft), "e2e_ms": _ms(self.e2e), "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens, "error": self.error,
        }


class PrefixTrie:
    """Token-id trie holding every inserted sequence: the infinite cache of the ideal hit rate."""

    def __init__(self) -> None:
        self._root: dict[int, dict] = {}

    def insert(self, seq: Iterable[int]) -> None:
        node = self._root
        for tok in seq:
            node = node.setdefault(tok, {})

    def longest_prefix(self, seq: Iterable[int]) -> int:
        node, length = self._root, 0
        for tok in seq:
            child = node.get(tok)
            if child is None:
                break
            node, length = child, length + 1
        return length


def ideal_cached_tokens(requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
    """For each (prompt, output) in send order, the tokens of its prompt an infinite cache could serve."""
    trie = PrefixTrie()
    cached = []
    for prompt, output in requests:
        cached.append(min(trie.longest_prefix(prompt), max(len(prompt) - 1, 0)))
        trie.insert([*prompt, *output])
    return cached


def percentiles_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    arr = np.asarray(values_s, dtype=np.float64) * 1e3
    return {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES} | {"mean": float(arr.mean())}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _hit_rate(cached: int, prompt: int) -> float | None:
    return cached / prompt if prompt else None


def summarize(system: str, records: Sequence[RequestRecord], duration_s: float, *, note: str = "") -> dict[str, Any]:
    """One system's row of the report (latencies in ms), plus the per-turn hit rates."""
    done = sorted((r for r in records if r.ok), key=lambda r: r.send_time)
    ideal = ideal_cached_tokens([(r.prompt_ids, r.output_ids) for r in done])
    prompt_tokens = sum(r.prompt_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    itls = [gap for r in done for gap in r.inter_token_latencies()]
    per_turn = []
    for turn in sorted({r.turn for r in done}):
        idx = [i for i, r in enumerate(done) if r.turn == turn]
        turn_prompt = sum(done[i].prompt_tokens for i in idx)
        per_turn.append({
            "turn": turn, "requests": len(idx),
            "hit_rate": _hit_rate(sum(done[i].cached_tokens for i in idx), turn_prompt),
            "ideal_hit_rate": _hit_rate(sum(ideal[i] for i in idx), turn_prompt),
        })
    duration_s = max(duration_s, 1e-9)
    return {
        "system": system,
        "note": note,
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "input_throughput": prompt_tokens / duration_s,
        "output_throughput": sum(r.completion_tokens for r in done) / duration_s,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": sum(r.completion_tokens for r in done),
        "cached_tokens": cached_tokens,
        "ideal_cached_tokens": sum(ideal),
        "cache_hit_rate": _hit_rate(cached_tokens, prompt_tokens),
        "ideal_cache_hit_rate": _hit_rate(sum(ideal), prompt_tokens),
        "ttft_ms": percentiles_ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": percentiles_ms(itls),
        "e2e_ms": percentiles_ms([r.e2e for r in done if r.e2e is not None]),
        "per_turn": per_turn,
    }
