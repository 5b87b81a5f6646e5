"""Share of sampled tool calls that parse and validate, with the xgrammar constraint on and off.

Starts a runtime on the default model (SmolLM2-135M-Instruct) with the shipped tool template and the
qwen25 parser, serves the HTTP API in this process, and asks the `openai` client for --samples tool
calls at temperature 1 (tool_choice "required", one call per answer, --per-request choices per
request). A sample counts as valid when the answer holds a call of a declared function whose
arguments are JSON that validates against its schema. String arguments carry a maxLength: unbounded,
a sampled string may run past max_tokens and cut the call (finish_reason "length"). Run once per setting:

    python scripts/tool_call_validity.py                 # constrained (the default)
    python scripts/tool_call_validity.py --unconstrained # --disable-tool-call-constraint
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import openai

from sgl_lite.http.app import create_app
from sgl_lite.http.launch import HttpServerThread
from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.client import RuntimeClient

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 80},
                                                        "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                       "required": ["query"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What's the weather in Paris?", "What is 17 plus 25?", "Find recent news about solar power.",
             "Is it cold in Oslo right now, in fahrenheit?", "Add 3 and 4 for me.", "Search for a pancake recipe."]


def valid(message: object) -> bool:
    for call in getattr(message, "tool_calls", None) or ():
        try:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        except (ValueError, KeyError, jsonschema.ValidationError):
            return False
    return bool(getattr(message, "tool_calls", None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--per-request", type=int, default=25, help="choices (n) per request")
    parser.add_argument("--unconstrained", action="store_true", help="start with --disable-tool-call-constraint")
    parser.add_argument("--max-tokens", type=int, default=64, help="a call here takes about 35 tokens")
    args = parser.parse_args()

    runtime = Runtime(model_path=args.model_path, chat_template="smollm2-tools", tool_call_parser="qwen25",
                      disable_tool_call_constraint=args.unconstrained, random_seed=0, startup_timeout=600)
    http = HttpServerThread(create_app(RuntimeClient(runtime.address), served_model_name="default"))
    client = openai.OpenAI(base_url=http.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    good = total = 0
    start = time.perf_counter()
    try:
        request = 0
        while total < args.samples:
            n = min(args.per_request, args.samples - total)
            question = QUESTIONS[request % len(QUESTIONS)]
            response = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": question}], tools=TOOLS,
                tool_choice="required", parallel_tool_calls=False, temperature=1.0, n=n, seed=request * 1000,
                max_tokens=args.max_tokens)
            for choice in response.choices:
                ok = valid(choice.message)
                good += ok
                total += 1
                if not ok:
                    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
                    print(f"  invalid ({choice.finish_reason}): content={choice.message.content!r} calls={calls}",
                          flush=True)
            request += 1
            print(f"  {good}/{total} valid so far", flush=True)
    finally:
        http.stop()
        runtime.shutdown()
    setting = "off" if args.unconstrained else "on"
    print(f"constraint {setting}: {good}/{total} sampled tool calls parsed and validated "
          f"({100.0 * good / total:.0f}%) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
