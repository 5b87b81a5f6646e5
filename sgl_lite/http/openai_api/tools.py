"""A chat request's tools: checked, turned into the template's `tools`, a parser, and the xgrammar
structural tag that makes every call the model writes valid.

tool_choice (OpenAI's): "none" (no calls; with the constraint on, the model cannot open one),
"auto" (text, calls, or both; a started call can only be a declared function with schema-valid
arguments), "required" (one or more calls and nothing else), or a named function (exactly that call).
parallel_tool_calls=false allows one call at most.

With response_format too (pydantic-ai's NativeOutput with tools, for one), the answer schema
joins the grammar: "auto" allows either one or more calls or the schema's JSON, "none" only the
schema's JSON, "required" and a named function only calls (as vLLM and SGLang accept both).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from sgl_lite.http.errors import bad_request
from sgl_lite.http.openai_api.protocol import ChatCompletionRequest, NamedToolChoice
from sgl_lite.http.openai_api.tool_parsers import PARSERS, ToolCallParser

# Every size has a limit: a schema is compiled into a grammar over the vocabulary.
MAX_SCHEMA_BYTES = 64 * 1024  # one tool's parameters, serialized
MAX_TOTAL_SCHEMA_BYTES = 256 * 1024  # all tools of a request
MAX_SCHEMA_DEPTH = 32  # nesting of objects/arrays in a schema (a property level is two: properties, its schema)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Whitespace the model may put between JSON tokens of the arguments (none would fight its habit of `": "`).
_MAX_JSON_WHITESPACE = 1


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]  # as OpenAI sends them; what the chat template gets
    choice: str  # none | auto | required | named
    named: str | None
    parallel: bool
    parser_class: type[ToolCallParser]
    constrained: bool
    answer_schema: dict[str, Any] | None = None  # response_format's JSON Schema, when the request has one

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def parser(self) -> ToolCallParser:
        names = {self.named} if self.named else {t["function"]["name"] for t in self.tools}
        return self.parser_class(names, stop_after_first=not self.parallel or self.choice == "named")

    def structural_tag(self) -> dict[str, Any] | None:
        if not self.constrained:
            return None
        fmt = self.parser_class
        answer = None
        if self.answer_schema is not None:
            answer = {"type": "json_schema", "json_schema": self.answer_schema, "max_whitespace_cnt": _MAX_JSON_WHITESPACE}
        if self.choice == "none":
            return _structural(answer or {"type": "any_text", "excludes": [fmt.call_trigger]})
        tools = [t for t in self.tools if self.named is None or t["function"]["name"] == self.named]
        tags = [{"type": "tag", "begin": fmt.call_begin(t["function"]["name"]),
                 "content": {"type": "json_schema", "json_schema": t["function"].get("parameters") or _EMPTY_PARAMETERS,
                             "max_whitespace_cnt": _MAX_JSON_WHITESPACE},
                 "end": fmt.call_end} for t in tools]
        if self.choice == "named":
            return _structural(tags[0])
        calls = {"type": "tags_with_separator", "tags": tags, "separator": fmt.call_separator, "at_least_one": True,
                 "stop_after_first": not self.parallel}
        if self.choice == "required":
            return _structural(calls)
        if answer is not None:  # auto: the calls, or the answer the schema describes
            return _structural({"type": "or", "elements": [calls, answer]})
        return _structural({"type": "triggered_tags", "triggers": [fmt.call_trigger], "tags": tags,
                            "stop_after_first": not self.parallel})


def _structural(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


def tool_request(body: ChatCompletionRequest, parser_name: str | None, renders_tools: bool,
                 constrain: bool) -> ToolRequest | None:
    """The request's tool settings, or None without tools; HttpError 400 naming the field at fault."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice: needs tools; the request has none", "tool_choice")
        return None
    if parser_name is None:
        raise bad_request("tools: this server parses no tool calls; start it with --tool-call-parser "
                          f"({', '.join(PARSERS)})", "tools")
    if not renders_tools:
        raise bad_request("tools: the model's chat template does not render tools or tool calls; start the server "
                          "with --chat-template naming a tool-capable template (smollm2-tools for SmolLM2)", "tools")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    check_tools(tools)
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice: function {named!r} is not among the request's tools", "tool_choice")
    mode = "named" if named else (choice or "auto")
    if constrain and (body.regex is not None or body.ebnf is not None):
        raise bad_request("tools: constrained tool calls cannot be combined with regex or ebnf", "tools")
    try:
        answer_schema = body.json_schema() if constrain else None
    except ValueError as e:
        raise bad_request(str(e), "response_format") from None
    return ToolRequest(tools, mode, named, body.parallel_tool_calls, PARSERS[parser_name], constrain, answer_schema)


def check_tools(tools: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    total = 0
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        where = f"tools[{i}].function"
        if name in seen:
            raise bad_request(f"{where}.name: {name!r} is declared twice", f"{where}.name")
        seen.add(name)
        parameters = tool["function"].get("parameters")
        if parameters is None:
            continue
        size = len(json.dumps(parameters))
        total += size
        if size > MAX_SCHEMA_BYTES or total > MAX_TOTAL_SCHEMA_BYTES:
            raise bad_request(f"{where}.parameters: schema too large ({size} bytes; at most {MAX_SCHEMA_BYTES} per "
                              f"tool and {MAX_TOTAL_SCHEMA_BYTES} per request)", f"{where}.parameters")
        problem = _schema_problem(parameters)
        if problem is not None:
            raise bad_request(f"{where}.parameters: {problem}", f"{where}.parameters")


def _schema_problem(schema: dict[str, Any]) -> str | None:
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        return f"schema nested deeper than {MAX_SCHEMA_DEPTH} levels"
    if schema.get("type", "object") != "object":
        return f"the parameters schema must describe an object; got type {schema.get('type')!r}"
    remote = _remote_ref(schema)
    if remote is not None:
        return f"only local $ref (#/...) is supported; got {remote!r}"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return f"not a valid JSON Schema: {e.message}"
    return None


def _depth(value: Any) -> int:
    # Iterative: a hostile schema must not exhaust the recursion limit here.
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _remote_ref(value: Any) -> str | None:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None
