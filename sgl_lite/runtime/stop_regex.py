"""A request's `stop_regex` patterns (SGLang's field): the limits they are checked against, the longest text
one can match, and which ones are plain text.

SGLang's semantics, which the stop checker follows: a request stops on the token that completes a match of
any pattern (Python `re` syntax) in the text of its recent output, the finish reason names the pattern, and
the match stays in the text. SGLang's trim looks for the pattern's own text in the output, so only a pattern
that is plain text (`Paris`, two newlines) is cut from the final text the way a stop string is.

Torch-free and free of sgl_lite imports (rank 0): runtime/protocol.py checks every request with it.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

try:  # Python 3.11 renamed the parser module and hid it; its structure is the same
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse  # type: ignore[no-redef]

# SGLang's limits (srt/sampling/sampling_params.py): patterns per request, UTF-8 bytes per pattern.
MAX_STOP_REGEX_COUNT = 32
MAX_STOP_REGEX_BYTES = 256
# The longest match of a pattern with an unbounded repeat (`+`, `*`, `{n,}`), a backreference or a
# construct this module does not measure.
UNBOUNDED = 2**30


def stop_regex_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def check_stop_regex(value: str | list[str] | None) -> None:
    """ValueError naming stop_regex when a pattern is too long, there are too many, or one does not compile."""
    patterns = stop_regex_list(value)
    if len(patterns) > MAX_STOP_REGEX_COUNT:
        raise ValueError(f"stop_regex has {len(patterns)} patterns; at most {MAX_STOP_REGEX_COUNT}")
    for pattern in patterns:
        size = len(pattern.encode("utf-8", "surrogatepass"))
        if not pattern:
            raise ValueError("stop_regex has an empty pattern")
        if size > MAX_STOP_REGEX_BYTES:
            raise ValueError(f"stop_regex has a pattern of {size} bytes; at most {MAX_STOP_REGEX_BYTES}")
        _parsed(pattern)


def longest_match_chars(pattern: str) -> int:
    """An upper bound on the characters one match of `pattern` spans (UNBOUNDED when it has none)."""
    return min(_longest(_parsed(pattern)), UNBOUNDED)


def is_plain_text(pattern: str) -> bool:
    """True when `pattern` matches exactly its own text and nothing else (no metacharacter, no escape)."""
    parsed = _parsed(pattern)
    if any(op != sre_parse.LITERAL for op, _ in parsed) or parsed.state.flags & ~_DEFAULT_FLAGS:
        return False
    return "".join(chr(code) for _, code in parsed) == pattern


_DEFAULT_FLAGS = re.UNICODE


@functools.lru_cache(maxsize=1024)
def _parsed(pattern: str) -> Any:
    """The parse of a pattern that Python's `re` compiles (SGLang's syntax); ValueError naming stop_regex else."""
    try:
        with warnings.catch_warnings():  # a user's pattern is no place for the parser's FutureWarnings (nested sets)
            warnings.simplefilter("ignore")
            re.compile(pattern)
            return sre_parse.parse(pattern)
    except (re.error, OverflowError) as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
    except RecursionError:
        raise ValueError(f"stop_regex {pattern!r} nests too deeply") from None


def _longest(parsed: Any) -> int:
    total = 0
    for op, value in parsed:
        if op in (sre_parse.LITERAL, sre_parse.NOT_LITERAL, sre_parse.IN, sre_parse.ANY):
            total += 1
        elif op is sre_parse.SUBPATTERN:
            total += _longest(value[-1])
        elif op is sre_parse.BRANCH:
            total += max(_longest(branch) for branch in value[1])
        elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, getattr(sre_parse, "POSSESSIVE_REPEAT", None)):
            low, high, inner = value
            total += UNBOUNDED if high == sre_parse.MAXREPEAT else high * _longest(inner)
        elif op in (sre_parse.AT, sre_parse.ASSERT, sre_parse.ASSERT_NOT):
            pass  # zero-width: ^, $, \b, lookarounds
        elif op is getattr(sre_parse, "ATOMIC_GROUP", None):
            total += _longest(value)
        else:  # backreferences, conditionals: not measured
            total += UNBOUNDED
        if total >= UNBOUNDED:
            return UNBOUNDED
    return total
