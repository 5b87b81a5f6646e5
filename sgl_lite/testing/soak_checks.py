"""Checks of a soak's outcome (soak.py): one final per request, greedy outputs as unloaded (idle accounting: kv_accounting.py)."""

from __future__ import annotations

from typing import Any

from sgl_lite.runtime import protocol
from sgl_lite.testing.soak import RequestRecord, SoakConfig


def check_records(records: list[RequestRecord], config: SoakConfig) -> list[str]:
    """Exactly one final per request (unless its client left), nothing after it, streams add up."""
    problems = []
    for rec in records:
        if rec.api_error is not None:
            problems.append(f"{rec.rid}: {rec.api_error}")
            continue
        if rec.disconnected:
            continue
        if len(rec.finals) != 1:
            problems.append(f"{rec.rid}: {len(rec.finals)} final messages")
            continue
        if rec.after_final:
            problems.append(f"{rec.rid}: messages after the final one: {rec.after_final}")
        final = rec.final
        if isinstance(final, protocol.ErrorReply):
            if rec.action != "abort" and final.code not in ("queue_full", "aborted"):
                problems.append(f"{rec.rid}: unexpected error {final.code}: {final.message}")
            expected = any(reason in final.message for reason in config.expected_abort_reasons)
            if final.code == "aborted" and rec.action != "abort" and not expected:
                problems.append(f"{rec.rid}: aborted without being asked to: {final.message}")
        elif isinstance(final, protocol.Finished):
            if _aborted(final) and rec.action != "abort":
                problems.append(f"{rec.rid}: ended as aborted by its client without asking: {final.meta_info}")
            if rec.stream and ("".join(rec.chunks) != final.text or rec.chunk_ids != final.output_ids):
                problems.append(f"{rec.rid}: stream chunks {''.join(rec.chunks)!r} != final text {final.text!r}")
    return problems


def reference_outputs(engine: Any, records: list[RequestRecord]) -> dict[tuple[str, bool], list[int]]:
    """Greedy output ids per (prompt, ignore_eos) on an unloaded Engine, one request at a time, with the
    largest max_new_tokens any finished request asked for (a greedy run's shorter outputs are its prefixes)."""
    longest: dict[tuple[str, bool], int] = {}
    for rec in records:
        if rec.greedy and isinstance(rec.final, protocol.Finished):
            key = (rec.prompt, bool(rec.params.get("ignore_eos", False)))
            longest[key] = max(longest.get(key, 0), rec.params["max_new_tokens"])
    refs = {}
    for (prompt, ignore_eos), max_new in longest.items():
        out = engine.generate(prompt, {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": ignore_eos})
        refs[(prompt, ignore_eos)] = out["output_ids"]
    return refs


def greedy_mismatches(records: list[RequestRecord], refs: dict[tuple[str, bool], list[int]]) -> list[str]:
    problems = []
    for rec in records:
        if not (rec.greedy and isinstance(rec.final, protocol.Finished)):
            continue
        ref = refs[(rec.prompt, bool(rec.params.get("ignore_eos", False)))]
        # an aborted one answers with what it had generated: a prefix of the whole
        expected = ref[: len(rec.final.output_ids) if _aborted(rec.final) else rec.params["max_new_tokens"]]
        if rec.final.output_ids != expected:
            problems.append(f"{rec.rid}: greedy output {rec.final.output_ids} != unloaded {expected}")
    return problems


def _aborted(final: protocol.Finished) -> bool:
    """Ended by its client's abort (the output so far), not finished."""
    return (final.meta_info.get("finish_reason") or {}).get("type") == "abort"
