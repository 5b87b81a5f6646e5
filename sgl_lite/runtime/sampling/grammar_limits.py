"""Bounds on a request's constraint (regex / json_schema / ebnf), checked at admission before any
grammar work: converting and compiling grow super-linearly with a JSON schema's depth and with the
size of an enum, so an unbounded one could hold a compile worker for minutes and gigabytes.

Every check here is one linear, non-recursive pass over text at most `max_chars` long, so it is cheap
enough for the scheduler thread; conversion and compilation run later on the compile workers.
"""

from __future__ import annotations

import json
from typing import Any

from sgl_lite.runtime.protocol import SamplingParams


def check_grammar_limits(params: SamplingParams, max_chars: int, max_depth: int) -> None:
    """Raise ValueError naming the field and the limit when the constraint is too large or too deep,
    or when a JSON schema refers to a remote document."""
    for name in ("regex", "ebnf"):
        text = getattr(params, name)
        if text is not None and len(text) > max_chars:
            raise ValueError(f"{name} of {len(text)} characters exceeds --max-grammar-chars {max_chars}")
    schema = params.json_schema
    if schema is None:
        return
    if isinstance(schema, str):
        if len(schema) > max_chars:
            raise ValueError(f"json_schema of {len(schema)} characters exceeds --max-grammar-chars {max_chars}")
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise ValueError(f"json_schema nests deeper than --max-json-schema-depth {max_depth}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid json_schema: not valid JSON: {e}") from None
        _check_tree(schema, max_depth)
    else:
        _check_tree(schema, max_depth)  # first: serializing a very deep dict would recurse
        size = len(json.dumps(schema, separators=(",", ":")))
        if size > max_chars:
            raise ValueError(f"json_schema of {size} characters exceeds --max-grammar-chars {max_chars}")


def _check_tree(schema: Any, max_depth: int) -> None:
    """Depth and remote $refs, walked with an explicit stack (no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"json_schema nests deeper than --max-json-schema-depth {max_depth}")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                raise ValueError(f"json_schema: $ref {ref[:80]!r} points outside the schema; only local "
                                 "references ('#/...') are supported")
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
