"""Runtime logprobs (SGLang's meta_info lists) -> OpenAI's chat and completions logprobs shapes.

The runtime reports output_token_logprobs as [(logprob, token_id, text|None), ...] and
output_top_logprobs as one list of such triples per position (or None). Today a stream carries
them, for the whole output, in its final chunk only; `LogprobCursor` hands out each position once,
whenever its entry first shows up, and also copes with chunks that carry only their new positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_lite.http.token_text import TokenTexts


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


class LogprobCursor:
    """Remembers how many output positions of one request were already turned into logprobs."""

    def __init__(self) -> None:
        self._taken = 0

    def take(self, meta_info: dict[str, Any]) -> list[TokenLogprob]:
        chosen = meta_info.get("output_token_logprobs") or []
        if not chosen:
            return []  # a progress chunk without logprobs: nothing to hand out yet
        tops = meta_info.get("output_top_logprobs") or []
        # Lists shorter than the output so far hold its last positions only (an incremental chunk).
        total = meta_info.get("completion_tokens")
        first_pos = total - len(chosen) if isinstance(total, int) and len(chosen) < total else 0
        out = []
        for i, entry in enumerate(chosen):
            if first_pos + i < self._taken:
                continue
            top_entries = tops[i] if i < len(tops) and tops[i] else []
            out.append(TokenLogprob(int(entry[1]), _finite(entry[0]), [(int(t[1]), _finite(t[0])) for t in top_entries]))
        self._taken = max(self._taken, first_pos + len(chosen))
        return out


def _finite(value: Any) -> float:
    # JSON has no -inf; OpenAI uses -9999.0 for "impossible".
    value = float(value) if value is not None else -9999.0
    return value if value > -9999.0 else -9999.0


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> list[dict[str, Any]]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        raw = texts.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, text_offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for e in entries:
        offsets.append(text_offset)
        token = texts.token_text(e.token_id)
        tokens.append(token)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{texts.token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def echoed_completion_logprobs(meta_info: dict[str, Any], texts: TokenTexts) -> dict[str, Any]:
    """Completions logprobs with echo: the prompt's tokens first (the first one unscored: null), then the output's."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for logprob, token_id, _ in meta_info.get("input_token_logprobs") or []:
        token = texts.token_text(int(token_id))
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        token_logprobs.append(None if logprob is None else _finite(logprob))
        tops.append(None if logprob is None else {token: _finite(logprob)})
    output = completion_logprobs(LogprobCursor().take(meta_info), texts, text_offset=offset)
    return {"tokens": tokens + output["tokens"], "token_logprobs": token_logprobs + output["token_logprobs"],
            "top_logprobs": tops + output["top_logprobs"], "text_offset": offsets + output["text_offset"]}
