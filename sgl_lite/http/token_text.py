"""Token id -> (text, bytes) for the `token` and `bytes` fields of OpenAI logprobs, and text -> ids for chat prompts.

The runtime reports logprobs by token id only. The HTTP front reads the model's `tokenizer.json`
(with the Rust `tokenizers` package; no transformers, no torch) when the model folder is reachable
from this process. Byte-level BPE vocabularies map each token to its exact bytes (a token may hold
part of a UTF-8 character, which OpenAI's `bytes` field exists for); other vocabularies use the
decoded text. Without a tokenizer file, tokens are named "token_id:<id>" (vLLM's convention).
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Callable

from sgl_lite.http.content_specials import HiddenSpecials, SpecialTokenText
from sgl_lite.http.prompt_token_cache import PromptTokenCache

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character of each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def _has_byte_level_decoder(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level_decoder(d) for d in decoder.get("decoders") or ())


class TokenTexts:
    def __init__(self, model_path: str | None) -> None:
        self._tokenizer = None
        self._byte_level = False
        self._cache: dict[int, bytes] = {}
        self._special_text: SpecialTokenText | None = None
        self._prompt_cache: PromptTokenCache | None = None  # chat prompts' ids reused turn to turn
        # The most characters a token decodes to (the longest vocabulary entry; byte-level: one per byte), as
        # the runtime bounds a prompt text by before tokenizing it; None without a tokenizer file.
        self.max_token_chars: int | None = None
        tokenizer_file = Path(model_path) / "tokenizer.json" if model_path else None
        if tokenizer_file is None or not tokenizer_file.is_file():
            logger.info("no tokenizer.json next to the model; logprob tokens are named by id")
            return
        try:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
            self._byte_level = _has_byte_level_decoder(json.loads(tokenizer_file.read_text(encoding="utf-8")).get("decoder"))
            # Built here, once (this runs off the event loop, when the model context is fetched).
            self._prompt_cache = PromptTokenCache(self._tokenizer)
            self._special_text = SpecialTokenText(self._tokenizer, self._prompt_cache)
            self.max_token_chars = max((len(piece) for piece in self._tokenizer.get_vocab(with_added_tokens=True)),
                                       default=1)
        except Exception as e:  # a corrupt or unknown tokenizer file must not take the API down
            logger.warning("could not load %s (%s); logprob tokens are named by id", tokenizer_file, e)
            self._tokenizer = self._special_text = self._prompt_cache = self.max_token_chars = None

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._lookup(token_id)
        return cached

    def _lookup(self, token_id: int) -> bytes:
        if self._tokenizer is None:
            return f"token_id:{token_id}".encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return f"token_id:{token_id}".encode()
        if self._byte_level:
            decoder = _byte_decoder()
            if all(ch in decoder for ch in piece):
                return bytes(decoder[ch] for ch in piece)
            return piece.encode()  # an added/special token stored verbatim
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @property
    def available(self) -> bool:
        """Whether the model's tokenizer file was read (else tokens are only named by id)."""
        return self._tokenizer is not None

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, its added tokens included (0 without a tokenizer file)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True) if self._tokenizer is not None else 0

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Text -> ids (the tokenizer's special tokens added when asked); needs `available`."""
        return self.encode_many([text], add_special_tokens)[0]

    def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Each text's ids. The tokenizer's batch call releases the GIL while it works (its one-text
        call does not), so a long text does not stall the event loop's thread meanwhile."""
        assert self._tokenizer is not None, "no tokenizer file"
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids (below vocab_size) -> text, special tokens written out unless skipped; needs `available`."""
        assert self._tokenizer is not None, "no tokenizer file"
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str:
        """The vocabulary's own string of an id (transformers' convert_ids_to_tokens), e.g. "Ġthe"."""
        piece = self._tokenizer.id_to_token(token_id) if self._tokenizer is not None else None
        return piece if piece is not None else f"token_id:{token_id}"

    def hidden_specials(self) -> HiddenSpecials | None:
        """A table for one chat's messages whose special-token strings are to stay plain text
        (content_specials.py); None without a tokenizer file or without special tokens."""
        special = self._special_text
        return special.hidden() if special is not None else None

    def chat_encoder(self, hidden: HiddenSpecials | None = None,
                     add_special_tokens: bool = False) -> Callable[[str], list[int]] | None:
        """Rendered chat text -> ids (how a rendered chat template is tokenized: by default without the
        tokenizer's special tokens, which the template writes), the special-token strings that messages
        passed through `hidden.hide` wrote as plain text; None without a tokenizer file."""
        special = self._special_text
        if special is None:
            return None
        if hidden is None:
            cache = self._prompt_cache
            if cache is not None and not add_special_tokens:
                return cache.encode
            return lambda text: self.encode(text, add_special_tokens)
        return lambda text: special.encode(text, hidden, add_special_tokens)

    def remember_answer(self, prompt_ids: list[int], output_ids: list[int]) -> bool:
        """Keeps a chat prompt's ids and the ids generated after it for the chat prompts that continue their
        text (prompt_token_cache.py, `remember`); False when not kept (no tokenizer file, or an id past the
        tokenizer's vocabulary: a model's embedding may be padded past it)."""
        cache = self._prompt_cache
        if cache is None or not output_ids or max(output_ids) >= self.vocab_size or min(output_ids) < 0:
            return False
        return cache.remember([*prompt_ids, *output_ids])

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")
