"""Bounds on a request's constraint (regex / json_schema / ebnf / structural_tag), checked at admission
before any grammar work: converting and compiling grow super-linearly with a JSON schema's depth and
with the size of an enum, so an unbounded one could hold a compile worker for minutes and gigabytes.

Every check here is one linear, non-recursive pass over text at most `max_chars` long, so it is cheap
enough for the scheduler thread; conversion and compilation run later on the compile workers.
"""

from __future__ import annotations

import json
from typing import Any

from sgl_lite.runtime.protocol import SamplingParams


def check_grammar_limits(params: SamplingParams, max_chars: int, max_depth: int) -> None:
    """Raise ValueError naming the field and the limit when the constraint is too large or too deep,
    or when a JSON schema (alone, or inside a structural tag) refers to a remote document."""
    for name in ("regex", "ebnf"):
        text = getattr(params, name)
        if text is not None and len(text) > max_chars:
            raise ValueError(f"{name} of {len(text)} characters exceeds --max-grammar-chars {max_chars}")
    for name in ("json_schema", "structural_tag"):  # JSON, as a string or an object
        spec = getattr(params, name)
        if spec is not None:
            _check_json_spec(name, spec, max_chars, max_depth)


def _check_json_spec(name: str, spec: Any, max_chars: int, max_depth: int) -> None:
    if isinstance(spec, str):
        if len(spec) > max_chars:
            raise ValueError(f"{name} of {len(spec)} characters exceeds --max-grammar-chars {max_chars}")
        try:
            spec = json.loads(spec)
        except RecursionError:
            raise ValueError(f"{name} nests deeper than --max-json-schema-depth {max_depth}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid {name}: not valid JSON: {e}") from None
        _check_tree(name, spec, max_depth)
    else:
        _check_tree(name, spec, max_depth)  # first: serializing a very deep dict would recurse
        size = len(json.dumps(spec, separators=(",", ":")))
        if size > max_chars:
            raise ValueError(f"{name} of {size} characters exceeds --max-grammar-chars {max_chars}")


def _check_tree(name: str, schema: Any, max_depth: int) -> None:
    """Depth and remote $refs, walked with an explicit stack (no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"{name} nests deeper than --max-json-schema-depth {max_depth}")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                raise ValueError(f"{name}: $ref {ref[:80]!r} points outside the schema; only local "
                                 "references ('#/...') are supported")
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
