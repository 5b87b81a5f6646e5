"""A chat prompt's ids reused from turn to turn: the rendered text's longest cached prefix that ends right
after a special token, plus the ids of the rest.

An agent sends its whole history every turn, so the front would tokenize the same text again and again
(the longest part of its per-request work, before the runtime sees the request). A tokenizer splits its
added tokens out of the text before anything else, and tokenizes the pieces between them independently; so
where a special token can only ever be matched whole (safe_boundary_tokens), the ids of a text are the ids
of the text up to the end of such a token followed by the ids of the rest, exactly. The cache keeps, per
tokenized text, its prefix up to its last such token with that prefix's ids; the next turn, which starts
with the same text, tokenizes only what follows. Bounded by entries, characters and tokens (the default
bounds hold at most 16 MiB of text and about 36 MiB of ids), least recently used out first; a prefix over a
quarter of either bound is not kept.

An answer the model generated is kept the same way (`remember`): the prompt's ids and the answer's ids as the ids
of their text. Tokenizing an answer's text again can split it otherwise than the model wrote it ("\n\n" as one
token where the model wrote two; a sampled answer does so often), and the runtime's prefix cache, which holds
the ids generated, would then miss from there on. A later chat whose text continues that text, at a safe special
token (the template's end of the turn), gets those ids: a tokenization of the same text, the one the runtime has
cached.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter, OrderedDict
from typing import Any

MAX_ENTRIES = 512
MAX_CHARS = 4 * 1024 * 1024
MAX_TOKENS = 1024 * 1024


def safe_boundary_tokens(tokenizer: Any) -> list[str]:
    """The special tokens of a `tokenizers.Tokenizer` that, wherever their text occurs, are matched whole and
    alone: not stripping neighbouring spaces, not word-bound, and overlapping no added token (none contains
    one, none ends with the start of one or starts with the end of one, itself included)."""
    if not _pieces_encode_alone(tokenizer):
        return []
    added = [token for token in tokenizer.get_added_tokens_decoder().values() if token.content]
    contents = [token.content for token in added]
    safe = []
    for token in added:
        text = token.content
        if not token.special or token.lstrip or token.rstrip or token.single_word:
            continue
        if token.normalized and tokenizer.normalizer is not None:
            continue
        if any(text in other and text != other for other in contents):
            continue
        if any(_overlaps(other, text) for other in contents):
            continue
        safe.append(text)
    return safe


def _pieces_encode_alone(tokenizer: Any) -> bool:
    """Whether the text between two added tokens is tokenized the same wherever it sits: no normalizer, and no
    pre-tokenizer step that treats the text's start specially (Metaspace prepends only to the first piece,
    ByteLevel's add_prefix_space) - byte-level BPE as Llama 3 and SmolLM2 have it. Else nothing is cached."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("normalizer") is not None:
        return False
    steps, pending = [], [spec.get("pre_tokenizer")]
    while pending:
        step = pending.pop()
        if isinstance(step, dict):
            pending.extend(step.get("pretokenizers") or [])
            steps.append(step)
    return not any(step.get("type") == "Metaspace" or (step.get("type") == "ByteLevel" and step.get("add_prefix_space"))
                   for step in steps)


def _overlaps(first: str, second: str) -> bool:
    """Whether a proper suffix of one is a proper prefix of the other (either way round)."""
    for a, b in ((first, second), (second, first)):
        if any(a.endswith(b[:k]) for k in range(1, min(len(a), len(b)))):
            return True
    return False


class PromptTokenCache:
    """Text -> ids (no special tokens added) through `tokenizer` (a `tokenizers.Tokenizer`), reusing the ids
    of cached prefixes and remembered answers; thread-safe (renders of large chats run on worker threads)."""

    def __init__(self, tokenizer: Any, max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS,
                 max_tokens: int = MAX_TOKENS) -> None:
        if min(max_entries, max_chars, max_tokens) < 1:
            raise ValueError(f"max_entries, max_chars and max_tokens must be positive; got {max_entries}, {max_chars}, "
                             f"{max_tokens}")
        self._tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.max_tokens = max_tokens
        boundaries = sorted(safe_boundary_tokens(tokenizer), key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, boundaries))) if boundaries else None
        self._boundary_ids = {text: tokenizer.token_to_id(text) for text in boundaries}
        added = {token_id: token.content for token_id, token in tokenizer.get_added_tokens_decoder().items()
                 if token.content}
        self._added_ids = frozenset(added)
        contents = sorted(set(added.values()), key=len, reverse=True)
        self._added_pattern = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._entries: OrderedDict[str, list[int]] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # how many entries have each length: most cuts are skipped unsliced
        self._chars = 0
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def chars(self) -> int:
        return self._chars

    @property
    def tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, as the tokenizer gives them for the whole text (but where it continues a
        remembered answer: those ids); its prefix up to its last safe special token is kept for the next text
        that starts with it."""
        if self._pattern is None:
            return self._encode([text])[0]
        boundaries = [(match.end(), match.group()) for match in self._pattern.finditer(text)]
        start, prefix = self._longest_prefix(text, boundaries)
        last = boundaries[-1][0] if boundaries else 0
        if last <= start:
            return prefix + self._encode([text[start:]])[0]
        middle, rest = self._encode([text[start:last], text[last:]])
        kept = prefix + middle
        self._store(text[:last], kept)
        return kept + rest

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # The batch call releases the GIL while it works; the fast one skips the offsets nobody reads here.
        return [encoding.ids for encoding in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def remember(self, ids: list[int]) -> bool:
        """Keeps `ids` (a prompt this cache encoded and the ids generated after it) as the ids of the text they
        decode to, for the texts that continue it after a safe special token. Not kept (False): ids whose text
        is not exactly theirs (a character cut short, U+FFFD) or spells an added token in ordinary tokens, or
        over a quarter of a bound; without safe special tokens nothing is looked up, so nothing is kept."""
        if self._pattern is None or not ids or len(ids) > self.max_tokens // 4:
            return False
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        if not text or len(text) > self.max_chars // 4 or "\ufffd" in text:
            return False
        spelled = len(self._added_pattern.findall(text)) if self._added_pattern is not None else 0
        if spelled != sum(token_id in self._added_ids for token_id in ids):
            return False
        self._store(text, list(ids), replace=True)
        return True

    def _longest_prefix(self, text: str, boundaries: list[tuple[int, str]]) -> tuple[int, list[int]]:
        """(where the longest cached prefix ends, its ids); (0, []) when none is cached. A prefix ends after a
        safe special token: cached up to its end, or (a remembered answer) up to its start, the token's id
        added."""
        with self._lock:
            for cut, token in reversed(boundaries):
                before = cut - len(token)
                for end, tail in ((cut, ()), (before, (self._boundary_ids[token],))):
                    if end <= 0 or not self._lengths[end]:
                        continue
                    key = text[:end]
                    ids = self._entries.get(key)
                    if ids is not None:
                        self._entries.move_to_end(key)
                        return cut, [*ids, *tail]
        return 0, []

    def _store(self, prefix: str, ids: list[int], replace: bool = False) -> None:
        """Keeps `ids` for `prefix`; an entry already kept stays unless `replace`."""
        if len(prefix) > self.max_chars // 4 or len(ids) > self.max_tokens // 4:
            return
        with self._lock:
            if prefix in self._entries:
                self._entries.move_to_end(prefix)
                if not replace:
                    return
                old_ids = self._entries[prefix]
                self._tokens += len(ids) - len(old_ids)
                self._entries[prefix] = ids
                self._evict()
                return
            self._entries[prefix] = ids
            self._lengths[len(prefix)] += 1
            self._chars += len(prefix)
            self._tokens += len(ids)
            self._evict()

    def _evict(self) -> None:
        """Least recently used entries out until within every bound (the lock held)."""
        while len(self._entries) > self.max_entries or self._chars > self.max_chars or self._tokens > self.max_tokens:
            old, old_ids = self._entries.popitem(last=False)
            self._tokens -= len(old_ids)
            self._lengths[len(old)] -= 1
            if not self._lengths[len(old)]:
                del self._lengths[len(old)]
            self._chars -= len(old)
