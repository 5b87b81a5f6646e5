"""Token keys that ignore layout, for n-gram drafts of text a model copies with another layout.

A model that copies often lays the copy out anew: it pretty-prints a JSON object the prompt holds on one
line, re-indents code, puts list items on lines of their own. The copied tokens then differ from the
source's around every break (`",\\n  "` where the source has `", "`), so the output's last tokens match
the source only a token or two back, and drafts end at each break. Keyed by their text without
whitespace, with whitespace-only tokens left out, the two match again: the proposer looks the request's
last keys up among its earlier ones and drafts the source's own tokens after the matched position, which
the model accepts up to the next place where the two layouts differ.
"""

from __future__ import annotations

from typing import Any

import numpy as np

WHITESPACE = -1  # the key of a token that is only whitespace: left out of the layout-free sequence


def layout_free_keys(tokenizer: Any, vocab_size: int) -> np.ndarray | None:
    """Per token id (int64 [vocab_size]): WHITESPACE for a token that decodes to whitespace only, else a key
    shared by the tokens whose text is the same once whitespace is stripped (` "` and `"`). A token that
    decodes to part of a UTF-8 character (the replacement character) or has no text in the tokenizer keeps a
    key of its own. None without a tokenizer that decodes ids."""
    if tokenizer is None or not hasattr(tokenizer, "batch_decode"):
        return None
    known = min(vocab_size, len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in range(known)])
    ids: dict[object, int] = {}
    keys = np.empty(vocab_size, dtype=np.int64)
    for i in range(vocab_size):
        text = texts[i].strip() if i < known else None
        if text == "":
            keys[i] = WHITESPACE
            continue
        name = ("id", i) if text is None or "\ufffd" in text else text
        keys[i] = ids.setdefault(name, len(ids))
    return keys


def grown(buffer: np.ndarray, needed: int, kept: int) -> np.ndarray:
    """`buffer` if it holds `needed` entries, else a new one of at least twice its size (64 at least) with
    its first `kept` entries: a buffer that grows by appends costs what is appended, not what it holds."""
    if needed <= buffer.shape[0]:
        return buffer
    bigger = np.empty(max(needed, 2 * buffer.shape[0], 64), dtype=buffer.dtype)
    bigger[:kept] = buffer[:kept]
    return bigger


class LayoutFreeView:
    """A request's tokens as layout-free keys, whitespace-only tokens left out, with each kept token's
    position in the request's tokens; grown by the tokens new since the last call (`grown` buffers)."""

    def __init__(self) -> None:
        self._keys = np.empty(0, dtype=np.int64)
        self._positions = np.empty(0, dtype=np.int64)
        self.length = 0  # keys held
        self.done = 0  # request tokens seen

    def truncate(self, done: int) -> None:
        """Forget the request's tokens from position `done` on (they were replaced)."""
        if done < self.done:
            self.length = int(np.searchsorted(self._positions[: self.length], done))
            self.done = done

    def update(self, tokens: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(keys, positions) for `tokens`, a request's tokens of which the first `done` were seen before."""
        if tokens.shape[0] > self.done:
            new = table[tokens[self.done :]]
            kept = np.flatnonzero(new != WHITESPACE)
            end = self.length + kept.shape[0]
            self._keys = grown(self._keys, end, self.length)
            self._positions = grown(self._positions, end, self.length)
            self._keys[self.length : end] = new[kept]
            self._positions[self.length : end] = kept + self.done
            self.length, self.done = end, tokens.shape[0]
        return self._keys[: self.length], self._positions[: self.length]
