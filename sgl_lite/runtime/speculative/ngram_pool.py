"""A bounded pool of recent requests' outputs that n-gram drafts may come from (SGLang's n-gram cache).

A request whose own prompt and output hold no earlier occurrence of its last tokens, or only a short
one (a single common token), may still be writing what another request wrote: the same tool-call
skeleton, the same closing sentence, the same JSON keys. Finished outputs are kept, newest last, in one token array of at most `capacity` tokens
(`--speculative-ngram-capacity`; the oldest outputs are dropped whole, and one longer than the pool
keeps its tail), separated by a token id no model has (-1) so that no match spans two outputs. A
lookup is the proposer's own suffix match run over the pool followed by the request's last tokens:
the latest occurrence of the longest suffix, and the tokens that followed it there; the proposer takes
it when it is longer than the request's own match.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

SEPARATOR = -1


class NgramPool:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"--speculative-ngram-capacity must be >= 1 to keep a pool; got {capacity}")
        self.capacity = capacity
        self._outputs: deque[np.ndarray] = deque()
        self._size = 0  # tokens held, separators included
        self._joined: np.ndarray | None = np.empty(0, dtype=np.int64)  # None: rebuild on next lookup

    @property
    def size(self) -> int:
        return self._size

    def add(self, output_ids: Sequence[int]) -> None:
        """Keep a finished request's output (its last `capacity - 1` tokens at most)."""
        if len(output_ids) < 2:
            return
        tokens = np.asarray(output_ids[-(self.capacity - 1):], dtype=np.int64)
        self._outputs.append(tokens)
        self._size += tokens.shape[0] + 1
        while self._size > self.capacity:
            self._size -= self._outputs.popleft().shape[0] + 1
        self._joined = None

    def clear(self) -> None:
        self._outputs.clear()
        self._size = 0
        self._joined = np.empty(0, dtype=np.int64)

    def joined(self) -> np.ndarray:
        """Every kept output followed by SEPARATOR, oldest first."""
        if self._joined is None:
            parts = [np.append(tokens, SEPARATOR) for tokens in self._outputs]
            self._joined = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return self._joined
