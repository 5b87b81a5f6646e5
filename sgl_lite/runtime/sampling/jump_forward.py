"""Jump-forward decoding (SGLang's compressed FSM): text the grammar forces is appended in one step.

When a constrained request's matcher admits exactly one continuation for a while (`{"name": "` at the
start of a JSON object, `", "status": "` between two fixed keys, the tail of an enum value once its
first letters decide it), xgrammar's `find_jump_forward_string` returns that text. Decoding it token by
token costs one forward per token for text that is already known; jump-forward appends it at once and
the next forward computes its KV as an extend (several query rows of that request in the decode
forward), sampling the token after it.

Retokenization (the rule SGLang applies): the forced text is tokenized together with the text of the
request's last few output tokens, so that the tokens at the boundary are the ones the tokenizer makes
for the whole text (the model sampled `"` and the grammar forces `, "b": `: the tail becomes `",` `Ġ"`
`b` `":` as the tokenizer writes `", "b": `, not `"` `,` ...). The retokenized tail replaces the old
one from the first token where they differ; the KV of replaced tokens is freed and recomputed in the
extend. Rules that keep this exact and cheap:
- only the last RETOKENIZE_TAIL_TOKENS output tokens may be replaced, never a prompt token and never a
  token below `floor` (the caller's: tokens whose KV is in the radix tree, or that a stream has
  already sent, server/detokenizer.py holds back this many ids of such a request);
- the tail starts on a whole character (no U+FFFD in its text), and the new tokens must decode to
  exactly the old tail's text + the forced text, also after the token before the tail (a tokenizer that
  adds a leading space to a fragment, as SentencePiece does, fails this and so never jumps);
- a forced text that ends in whitespace stops before it: BPE tokenizers attach a space to the word after
  it (` true`, ` "`), so the model samples the space together with what follows;
- forced text that is not whole UTF-8 characters (a choice between `é` and `ê` shares its first
  byte) does not jump: the model decodes those bytes.

The retokenized tokens can differ from the tokens the model would have sampled for the same text, and
then the greedy continuation after them can differ too (the model conditions on tokens, not text);
both outputs are valid for the grammar. Where the model's own tokens at every jump agree with the
retokenization, greedy output is identical with and without jump-forward (tests/test_jump_forward_greedy.py).

This module finds a jump and moves the matcher; the scheduler (managers/scheduler_decode.py) applies
it to the request's output, KV, stop checks and logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the scheduler imports this module; xgrammar loads with the first grammar
    from sgl_lite.runtime.sampling.grammar_backend import GrammarMatcher

# How many of a request's last output tokens a jump may retokenize (and so how many output ids a
# stream of a constrained request holds back). Byte-level BPE merges stop at pre-token boundaries
# (a word, a number, a run of punctuation), which a tail this long spans.
RETOKENIZE_TAIL_TOKENS = 4
# A longer forced text (a long literal of an EBNF) jumps in pieces of this many characters, so one
# step's tokenizer work on the scheduler thread stays bounded.
MAX_JUMP_CHARS = 1024

REPLACEMENT_CHAR = "\ufffd"


def is_constrained(params: Any) -> bool:
    """Whether a request's sampling params carry a grammar (the requests that can jump)."""
    return any(getattr(params, kind, None) is not None for kind in ("regex", "json_schema", "ebnf", "structural_tag"))


@dataclass(frozen=True)
class Jump:
    """Replace `output_ids[keep:]` with `tokens`: the old tail's text followed by `text`, retokenized."""

    keep: int
    tokens: list[int]
    text: str  # the forced text (for logs and tests)


class JumpForward:
    """Finds a constrained request's jump (tokenizing on the caller's thread: the scheduler's)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def find(self, matcher: GrammarMatcher, input_ids: Sequence[int], output_ids: Sequence[int], floor: int) -> Jump | None:
        """The jump from the matcher's state (which has accepted `output_ids`), retokenizing output tokens
        at indices >= floor; None when nothing is forced or the text cannot be placed exactly."""
        text = matcher.jump_forward_string()[:MAX_JUMP_CHARS].rstrip()
        if not text:
            return None
        n = len(output_ids)
        start = min(max(n - RETOKENIZE_TAIL_TOKENS, floor, 0), n)
        tail_text = self._decode(output_ids[start:])
        while REPLACEMENT_CHAR in tail_text and start < n:  # the tail must start on a whole character
            start += 1
            tail_text = self._decode(output_ids[start:])
        if REPLACEMENT_CHAR in text:
            return None
        tokens = self._encode(tail_text + text)
        if self._decode(tokens) != tail_text + text:
            return None
        before = output_ids[start - 1] if start > 0 else (input_ids[-1] if input_ids else None)
        if before is not None and self._decode([before, *tokens]) != self._decode([before]) + tail_text + text:
            return None
        common = 0
        for old, new in zip(output_ids[start:], tokens):
            if old != new:
                break
            common += 1
        if common == len(tokens):  # cannot happen for a non-empty text; keeps the jump non-empty
            return None
        return Jump(keep=start + common, tokens=tokens[common:], text=text)


def move_matcher(matcher: GrammarMatcher, replaced: Sequence[int], tokens: Sequence[int]) -> bool:
    """Roll the matcher back over `replaced` (the output's last tokens) and accept `tokens` instead.

    False, with the matcher as it was, when the grammar refuses one of them (a special token the
    tokenizer made of the forced text, say).
    """
    matcher.rollback(len(replaced))
    accepted = 0
    for token in tokens:
        if not matcher.accept_token(token):
            break
        accepted += 1
    if accepted == len(tokens):
        return True
    matcher.rollback(accepted)
    for token in replaced:
        matcher.accept_token(token)
    return False
