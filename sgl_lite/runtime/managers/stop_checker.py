"""When a request stops, and how its final text drops the stop marker (SGLang's check_finished).

Order of checks after each new token (the first that applies wins):
1. max_new_tokens reached, or the sequence fills the context: LENGTH;
2. the grammar matcher terminated (it accepted EOS after a complete match): STOP(matched=token);
3. unless ignore_eos: the token is in stop_token_ids or is an EOS id: STOP(matched=token);
4. a stop string occurrence ENDS in the text of the newest token: STOP(matched=string); when several
   do, the one that starts first (StopStrings: one pass over the newest characters, however many);
5. a stop_regex match ends there: STOP(matched=pattern), SGLang's FINISHED_MATCHED_REGEX (StopRegexes).
Checks 3-5 wait until min_new_tokens outputs exist (the sampler masks EOS until then as well).

Check 4 looks only at occurrences that the newest token completes, so a stop string that appeared
before min_new_tokens were reached never ends the request later, and the match is always at the
end of the text. `trim_stop` cuts the final text at that same occurrence (not at the first one in
the text), so the final text always extends what was streamed (the streamer withholds the last
len(stop) - 1 characters, server/detokenizer.py). A stop_regex match stays in the text, as in SGLang,
unless the pattern is plain text (SamplingParams.trimmed_stops): then it is cut like a stop string.

Patterns are searched in the text of the last tokens that can hold a match (SGLang's bound: the
pattern's longest match), at most STOP_REGEX_WINDOW_TOKENS; with the `regex` engine, which takes a
time limit: a request whose patterns take longer than STOP_REGEX_SEARCH_SECONDS on one token (runaway
backtracking) ends with a 400 naming stop_regex, rather than stalling the batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import regex

from sgl_lite.runtime.managers.request import FinishKind, FinishReason, Req
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.stop_regex import longest_match_chars, stop_regex_list

# Byte-level BPE can spend up to 4 tokens on one character; decode this many tokens per stop-string char.
_TOKENS_PER_CHAR = 4
# The most output tokens whose text a stop_regex is searched in (a pattern with an unbounded repeat);
# and the time one request's patterns may take on one token.
STOP_REGEX_WINDOW_TOKENS = 1024
STOP_REGEX_SEARCH_SECONDS = 0.02


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.context_length = context_length

    def check(self, req: Req) -> FinishReason | None:
        params = req.sampling_params
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.context_length:
            return FinishReason(FinishKind.LENGTH)
        token = req.output_ids[-1]
        # A terminated grammar admits no further token, so it ends the request even before
        # min_new_tokens (the sampler likewise lets a grammar that allows only EOS win).
        if req.grammar is not None and req.grammar.is_terminated():
            return FinishReason(FinishKind.STOP, matched=token)
        if len(req.output_ids) < params.min_new_tokens:
            return None
        if not params.ignore_eos and (token in self.eos_token_ids or token in (params.stop_token_ids or ())):
            return FinishReason(FinishKind.STOP, matched=token)
        if params.stop is None and not params.stop_regex:
            return None
        if self.tokenizer is None:
            raise ValueError("stop strings and stop_regex need a tokenizer")
        if params.stop is not None and req.stop_strings is None:
            req.stop_strings = StopStrings(params.stop_strings())
        if params.stop_regex and req.stop_regexes is None:
            req.stop_regexes = StopRegexes(params.stop_regex)
        stops: StopStrings | None = req.stop_strings if params.stop is not None else None
        patterns: StopRegexes | None = req.stop_regexes if params.stop_regex else None
        window = max(_TOKENS_PER_CHAR * stops.max_length + 1 if stops else 0, patterns.window_tokens if patterns else 0)
        window_ids = req.output_ids[-window:]
        options = params.decode_options()
        tail = self.tokenizer.decode(window_ids, **options)
        new_from = _new_text_start(tail, self.tokenizer.decode(window_ids[:-1], **options))
        matched = stops.first_ending_in(tail, new_from) if stops else None
        if matched is None and patterns:
            try:
                matched = patterns.first_ending_in(tail, new_from)
            except TimeoutError as e:
                return FinishReason(FinishKind.ABORT, error_code="bad_request", message=str(e))
        return FinishReason(FinishKind.STOP, matched=matched) if matched is not None else None


class StopStrings:
    """A request's stop strings grouped by length, so that one pass over the newest token's few
    characters finds any of them: the cost per token grows with the number of distinct lengths
    (at most MAX_STOP_STRING_CHARS), not with the number of strings times the text."""

    def __init__(self, stops: list[str]) -> None:
        self._by_length: dict[int, set[str]] = {}
        for stop in stops:
            self._by_length.setdefault(len(stop), set()).add(stop)
        self._lengths = sorted(self._by_length)
        self.max_length = self._lengths[-1] if self._lengths else 0

    def first_ending_in(self, text: str, new_from: int) -> str | None:
        """The stop string of the earliest-starting occurrence that ends in text[new_from:], if any."""
        best_start, best = len(text), None
        for end in range(max(new_from, 0) + 1, len(text) + 1):
            for length in self._lengths:
                if length > end:
                    break
                start = end - length
                if start < best_start and text[start:end] in self._by_length[length]:
                    best_start, best = start, text[start:end]
        return best


class StopRegexes:
    """A request's stop_regex patterns compiled once (ValueError naming stop_regex if the engine refuses one),
    with the output tokens whose text can hold a match."""

    def __init__(self, value: str | list[str]) -> None:
        self.patterns: list[Any] = []
        for pattern in stop_regex_list(value):
            try:
                self.patterns.append(regex.compile(pattern))
            except (regex.error, RecursionError, OverflowError) as e:
                raise ValueError(f"stop_regex {pattern!r} does not compile: {e}") from None
        longest = max((longest_match_chars(p.pattern) for p in self.patterns), default=0)
        self.window_tokens = min(_TOKENS_PER_CHAR * longest + 1, STOP_REGEX_WINDOW_TOKENS)

    def first_ending_in(self, text: str, new_from: int) -> str | None:
        """The first pattern (in the request's order, as SGLang checks them) with a match that ends in
        text[new_from:]; TimeoutError when the search takes longer than STOP_REGEX_SEARCH_SECONDS."""
        deadline = time.monotonic() + STOP_REGEX_SEARCH_SECONDS
        for compiled in self.patterns:
            start = 0
            while start <= len(text):
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise TimeoutError
                    found = compiled.search(text, start, timeout=left)
                except TimeoutError:
                    raise TimeoutError(f"stop_regex {compiled.pattern!r} took more than {STOP_REGEX_SEARCH_SECONDS:g} s "
                                       f"to search {len(text)} characters of output (runaway backtracking): "
                                       "simplify the pattern") from None
                if found is None:
                    break
                if found.end() > new_from:
                    return compiled.pattern
                start = found.start() + 1  # an earlier match (under min_new_tokens): look past its start
        return None


def stop_match_start(text: str, text_before_last: str, stop: str) -> int:
    """Where the first occurrence of `stop` that ends in the newest token's text starts, or -1.

    `text_before_last` is the decoding without the newest token: the newest token's text starts
    where the two first differ (a completed multi-byte character replaces a trailing U+FFFD).
    """
    if not stop:
        return -1
    new_from = _new_text_start(text, text_before_last)
    # An occurrence starting at i ends at i + len(stop); it ends in the new text when that is > new_from.
    return text.find(stop, max(0, new_from - len(stop) + 1))


def _new_text_start(text: str, text_before_last: str) -> int:
    """Where the newest token's text starts: where the two decodings first differ."""
    common = min(len(text), len(text_before_last))
    return next((i for i in range(common) if text[i] != text_before_last[i]), common)


def trim_stop(text: str, text_before_last: str, reason: FinishReason | None, params: SamplingParams) -> str:
    """Cut the final text before the stop string occurrence that ended the request (unless no_stop_trim).

    `text_before_last` is the text without the last output token: the occurrence the checker found
    ends in that token's text. Were it not found (a tokenizer whose windowed decoding disagrees with
    its full decoding), the last occurrence is the closest to it.
    """
    if reason is None or params.no_stop_trim or not isinstance(reason.matched, str):
        return text
    if reason.matched not in params.trimmed_stops():  # a stop_regex match stays in the text
        return text
    cut = stop_match_start(text, text_before_last, reason.matched)
    if cut < 0:
        cut = text.rfind(reason.matched)
    return text[:cut] if cut >= 0 else text


def output_ids_for_text(output_ids: list[int], reason: FinishReason | None, params: SamplingParams) -> list[int]:
    """The ids whose text is returned: a matched stop token is left out (unless no_stop_trim)."""
    if reason is not None and reason.kind is FinishKind.STOP and isinstance(reason.matched, int) and not params.no_stop_trim:
        if output_ids and output_ids[-1] == reason.matched:
            return output_ids[:-1]
    return output_ids
