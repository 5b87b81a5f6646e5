"""Block keys: a token sequence cut into blocks of BLOCK_TOKENS, each keyed by a hash of every token up to its end.

Block i covers positions [i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS); its key chains the key of block i - 1 (its
parent; ROOT for block 0) with block i's tokens, so one key names one whole prefix: two sequences share block i's
key exactly when they share their first (i + 1) * BLOCK_TOKENS tokens. A partial last block (the fewer than
BLOCK_TOKENS tokens a prefix ends with) is keyed the same way over the tokens it has, so its key names the whole
prefix too. The hash (BLAKE2b of the tokens as little-endian int32) is the same in every process, so keys written
before a restart are found after it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK_TOKENS = 64
KEY_BYTES = 16
ROOT = ""  # the parent key of a prefix's first block


def chain_key(parent: str, tokens: Sequence[int]) -> str:
    """Hex key of the block of `tokens` that follows the block keyed `parent`."""
    block = array("i", tokens)
    if block.itemsize != 4:
        raise RuntimeError("block_keys needs a 4-byte C int for its stable token encoding")
    return hashlib.blake2b(bytes.fromhex(parent) + block.tobytes(), digest_size=KEY_BYTES).hexdigest()


def block_keys(tokens: Sequence[int], num_blocks: int | None = None, block_tokens: int = BLOCK_TOKENS) -> list[str]:
    """Hex keys of the first `num_blocks` whole blocks of `tokens` (all whole blocks when None)."""
    whole = len(tokens) // block_tokens
    count = whole if num_blocks is None else min(num_blocks, whole)
    keys: list[str] = []
    parent = ROOT
    for i in range(count):
        parent = chain_key(parent, tokens[i * block_tokens : (i + 1) * block_tokens])
        keys.append(parent)
    return keys
