"""Special-token strings inside chat messages, tokenized as plain text (`--split-special-tokens-in-messages`).

A chat template writes the model's control tokens (`<|im_start|>`, `<|im_end|>`, ...) itself. When a
message's text holds one of those strings too, transformers' `apply_chat_template(tokenize=True)`
(and so vLLM and SGLang) tokenizes it as that control token, because the rendered text is tokenized
as a whole: a user could close their own turn and write a system turn. transformers names the other
way `split_special_tokens` (special-token strings split into ordinary tokens); here it is applied to
what the messages wrote only, never to what the template wrote.

How, without changing any other token: before rendering, each special-token string in a message's text
is swapped for a placeholder (private-use characters around a per-request random number and a counter,
which a template copies like any other text); after rendering, the strings are put back and the text is
tokenized as usual, with character offsets, and each special token whose characters came from a message
is replaced by the ordinary tokens of those characters. A chat whose messages hold no special-token
string is tokenized exactly as before.
"""

from __future__ import annotations

import bisect
import re
import secrets
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl_lite.http.prompt_token_cache import PromptTokenCache

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no tokenizer gives them a special meaning


class HiddenSpecials:
    """One chat request's table: the special-token strings its messages wrote, each behind a placeholder."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self._pattern = pattern
        self._prefix = f"{_OPEN}{secrets.randbelow(10**15)}."
        self._placeholder = re.compile(re.escape(self._prefix) + r"(\d+)" + _CLOSE)
        self.literals: list[str] = []

    def hide(self, text: str) -> str:
        """`text` with each special-token string replaced by its placeholder."""
        return self._pattern.sub(self._swap, text)

    def hide_message(self, message: dict[str, Any]) -> dict[str, Any]:
        """A template message (chat_template.template_message) with the special-token strings of every text
        it holds hidden: content, name, tool_call_id, and each tool call's id, name and arguments (decoded
        arguments included, their keys too: the template writes them with `tojson`)."""
        return _map_strings(message, self.hide, skip_keys=frozenset({"role", "type"}))

    def _swap(self, match: re.Match[str]) -> str:
        self.literals.append(match.group())
        return f"{self._prefix}{len(self.literals) - 1}{_CLOSE}"

    def restore(self, rendered: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text with every placeholder back to its string, and the (start, end) of each in it."""
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        position = length = 0
        for match in self._placeholder.finditer(rendered):
            pieces.append(rendered[position:match.start()])
            length += match.start() - position
            literal = self.literals[int(match.group(1))]
            spans.append((length, length + len(literal)))
            pieces.append(literal)
            length += len(literal)
            position = match.end()
        pieces.append(rendered[position:])
        return "".join(pieces), spans


class SpecialTokenText:
    """A tokenizer's special tokens, and the encoding of a rendered chat in which the ones its messages
    wrote are plain text. `tokenizer` is a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Any, prompt_cache: PromptTokenCache | None = None) -> None:
        """`prompt_cache` (of the same tokenizer), when given, encodes the chats whose messages wrote no
        special-token string."""
        from tokenizers import Tokenizer

        specials = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()
                    if token.special and token.content}
        self._special_ids = frozenset(specials.values())
        # Longest first, so that a special token that begins with another one is matched whole.
        alternatives = sorted(specials, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        self._tokenizer = tokenizer
        self._prompt_cache = prompt_cache
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True  # special-token strings split into ordinary tokens

    def hidden(self) -> HiddenSpecials | None:
        """A table for one request's messages; None when the tokenizer has no special tokens."""
        return HiddenSpecials(self._pattern) if self._pattern is not None else None

    def encode(self, rendered: str, hidden: HiddenSpecials, add_special_tokens: bool) -> list[int]:
        """The ids of `rendered` (a template's output over messages passed through `hidden.hide`)."""
        text, spans = hidden.restore(rendered)
        if not spans and not add_special_tokens and self._prompt_cache is not None:
            return self._prompt_cache.encode(text)
        # encode_batch releases the GIL while it works (encode does not): the event loop keeps serving.
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if not spans:
            return encoding.ids
        starts = [start for start, _ in spans]
        ids: list[int] = []
        plain_pieces: list[tuple[int, str]] = []  # (where in ids, the characters to encode as text)
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self._special_ids and end > start and _from_a_message(starts, spans, start, end):
                plain_pieces.append((len(ids), text[start:end]))
                ids.append(-1)  # filled below
            else:
                ids.append(token_id)
        encoded = self._plain.encode_batch([piece for _, piece in plain_pieces], add_special_tokens=False)
        for (index, _), piece_encoding in reversed(list(zip(plain_pieces, encoded))):
            ids[index:index + 1] = piece_encoding.ids
        return ids


def _from_a_message(starts: list[int], spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether the characters [start, end) overlap a string a message wrote (spans sorted, disjoint)."""
    last = bisect.bisect_right(starts, end - 1) - 1
    return last >= 0 and spans[last][1] > start


def _map_strings(value: dict[str, Any], fn: Any, skip_keys: frozenset[str]) -> dict[str, Any]:
    """A copy of `value` with fn applied to every string in it (dict keys included, except at the top
    level, whose keys are the message's fields; `skip_keys` there keep their values). Iterative: decoded
    call arguments nest as deep as json.loads allows."""
    top = {key: item for key, item in value.items()}
    stack: list[tuple[Any, Any]] = [(top, key) for key in top if key not in skip_keys]
    while stack:
        container, key = stack.pop()
        node = container[key]
        if isinstance(node, str):
            container[key] = fn(node)
        elif isinstance(node, dict):
            copied = {fn(k) if isinstance(k, str) else k: item for k, item in node.items()}
            container[key] = copied
            stack.extend((copied, k) for k in copied)
        elif isinstance(node, list):
            copied_list = list(node)
            container[key] = copied_list
            stack.extend((copied_list, i) for i in range(len(copied_list)))
    return top
