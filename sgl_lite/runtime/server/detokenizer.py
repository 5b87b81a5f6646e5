"""Incremental detokenization for streamed output: text deltas that never split a character.

A byte-level BPE token can end in the middle of a UTF-8 sequence, so decoding the ids produced so
far can end in U+FFFD that the next token would complete. Like SGLang's and vLLM's detokenizers we
decode a short window `ids[prefix_offset:]` and compare it with the window's already-confirmed part
`ids[prefix_offset:read_offset]`: the difference is new text, confirmed only when it does not end
in U+FFFD (otherwise the offsets stay put and the bytes wait for the next token). Decoding a window
that starts a little before the new ids (instead of the new ids alone) keeps tokenizers whose
decoding depends on the previous token (leading-space handling) correct.

Invariant: the concatenation of every delta returned by `update` and the one returned by `finish`
equals the final text passed to `finish`, provided the streamed part is a prefix of it. That holds
because (a) only text that later tokens cannot change is streamed (confirmed text, plus the text
before a waiting window's trailing U+FFFD run) and (b) the last `hold_back_chars` characters are
withheld while the request runs: a stop string can only be trimmed from the final text starting
inside that withheld tail (the scheduler ends the request on the token that completes the stop
string, so before that at most len(stop) - 1 of its characters were in the text).

A constrained request's last output ids can still change while it runs: jump-forward retokenizes at
most its last RETOKENIZE_TAIL_TOKENS (sampling/jump_forward.py, never below what it may have sent).
Its stream state is made with `hold_back_ids` = that many, and reads (text and ids) only the ids before
them until `finish`, so the ids of its chunks also add up to the final output ids.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-request streaming state. `decode` maps token ids to text (the runtime's decode rule)."""

    def __init__(self, decode: Callable[[list[int]], str], hold_back_chars: int = 0, hold_back_ids: int = 0) -> None:
        self._decode = decode
        self._hold_back_chars = max(hold_back_chars, 0)
        self._hold_back_ids = max(hold_back_ids, 0)  # trailing ids that may still be replaced (until finish)
        self._prefix_offset = 0  # window start: ids before it are fully reflected in _confirmed
        self._read_offset = 0  # ids before it are decoded into _confirmed
        self._confirmed = ""  # decoded text of ids[:read_offset] (ends with a whole character)
        self._tentative = ""  # text of the ids after read_offset, up to their trailing U+FFFD run
        self._sent_chars = 0  # how much of _confirmed has been handed out
        self._sent_ids = 0  # how many output ids have been reported through `new_ids`

    def settled(self, output_ids: Sequence[int]) -> Sequence[int]:
        """The ids that can no longer change: all after `finish`, else all but the held-back ones."""
        if self._hold_back_ids == 0:
            return output_ids
        return output_ids[: max(len(output_ids) - self._hold_back_ids, 0)]

    def new_ids(self, output_ids: Sequence[int]) -> list[int]:
        """The ids produced since the previous call (reported with each chunk)."""
        output_ids = self.settled(output_ids)
        fresh = list(output_ids[self._sent_ids :])
        self._sent_ids = max(self._sent_ids, len(output_ids))
        return fresh

    def update(self, output_ids: Sequence[int]) -> str:
        """Take the full output ids so far; return the text that is safe to stream now (maybe "")."""
        output_ids = self.settled(output_ids)
        if len(output_ids) > self._read_offset:
            # only the window is copied: a long output's whole id list once per streamed token adds up
            settled_text = self._decode(list(output_ids[self._prefix_offset : self._read_offset]))
            window_text = self._decode(list(output_ids[self._prefix_offset :]))
            if len(window_text) > len(settled_text) and not window_text.endswith(REPLACEMENT_CHAR):
                self._confirmed += window_text[len(settled_text) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(output_ids)
                self._tentative = ""
            elif window_text.startswith(settled_text):
                # Only the trailing U+FFFD run can still change (UTF-8 decoding resynchronizes at
                # every complete character), so the text before it may be streamed already; this
                # keeps a stream moving through output that contains truly invalid bytes.
                self._tentative = window_text[len(settled_text) :].rstrip(REPLACEMENT_CHAR)
        text = self._confirmed + self._tentative
        streamable = len(text) - self._hold_back_chars
        if streamable <= self._sent_chars:
            return ""
        delta = text[self._sent_chars : streamable]
        self._sent_chars = streamable
        return delta

    def finish(self, final_text: str) -> str:
        """The last delta: whatever of `final_text` has not been streamed yet (every id is settled now)."""
        self._hold_back_ids = 0
        sent = (self._confirmed + self._tentative)[: self._sent_chars]
        if not final_text.startswith(sent):
            # Cannot be retracted any more; only a tokenizer whose windowed decoding disagrees with
            # its full decoding gets here. Say so rather than silently corrupting the text.
            logger.warning("streamed text %r is not a prefix of the final text %r", sent, final_text)
            common = 0
            while common < min(len(sent), len(final_text)) and sent[common] == final_text[common]:
                common += 1
            self._sent_chars = len(final_text)
            return final_text[common:]
        self._sent_chars = len(final_text)
        return final_text[len(sent) :]


def stop_hold_back_chars(stop_strings: Sequence[str]) -> int:
    """Characters to withhold while streaming so that no stop-string prefix is ever sent."""
    return max((len(s) for s in stop_strings), default=1) - 1


def chunk_due(produced: int, streamed: int, interval: int) -> bool:
    """Whether a stream's next chunk is due (SGLang's rule): with the first token, then once `interval` tokens
    are unsent; the rest comes with the last chunk. `produced`/`streamed`: output tokens now / at the last chunk."""
    unsent = produced - streamed
    return interval == 1 or unsent >= interval or (streamed == 0 and unsent > 0)
