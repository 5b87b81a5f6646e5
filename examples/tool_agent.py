"""A tool-calling agent over the OpenAI API: the `openai` client, a tool loop, several user turns.

Start a server on the default model with the shipped tool-capable template and the matching parser:

    sgl-lite serve --chat-template smollm2-tools --tool-call-parser qwen25 --port 30000

then run this file with the server's OpenAI base URL (the only thing that ties it to a server):

    python examples/tool_agent.py --base-url http://127.0.0.1:30000/v1

Each user turn runs the tool loop: the model must call a tool first (tool_choice="required", so even
a 135M model calls one; the xgrammar constraint makes the call valid), the tools run here, and the
model then answers from their results (tool_choice="none"). The whole conversation is resent every
step, so every step after the first should find its prefix in the server's radix cache: the hit
rate printed per step is cached prompt tokens / prompt tokens.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

import openai

WEATHER = {"paris": ("sunny", 21), "oslo": ("snow", -3), "tokyo": ("rain", 15)}


def get_weather(city: str, unit: str = "celsius") -> dict[str, Any]:
    sky, celsius = WEATHER.get(city.strip().lower(), ("cloudy", 12))
    degrees = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    return {"city": city, "sky": sky, "temperature": degrees, "unit": unit}


def add(a: int, b: int) -> dict[str, Any]:
    return {"sum": a + b}


FUNCTIONS: dict[str, Callable[..., dict[str, Any]]] = {"get_weather": get_weather, "add": add}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
QUESTIONS = ["What is the weather in Paris?", "And in Oslo, in fahrenheit?", "What is 19 plus 23?"]


def run_tool(call: Any) -> str:
    try:
        arguments = json.loads(call.function.arguments)
        return json.dumps(FUNCTIONS[call.function.name](**arguments))
    except (ValueError, TypeError, KeyError) as e:  # a tool error goes back to the model as the result
        return json.dumps({"error": f"{type(e).__name__}: {e}"})


def step(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], tool_choice: str) -> Any:
    response = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                              parallel_tool_calls=False, temperature=0, max_tokens=96)
    usage = response.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    print(f"    [{tool_choice:8s}] prompt {usage.prompt_tokens:4d} tokens, cached {cached:4d} "
          f"({100.0 * cached / max(usage.prompt_tokens, 1):5.1f}% prefix cache hit)")
    return response.choices[0].message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1", help="the server's OpenAI base URL")
    parser.add_argument("--api-key", default="EMPTY")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant with tools."}]
    for turn, question in enumerate(QUESTIONS, 1):
        print(f"turn {turn}: user: {question}")
        messages.append({"role": "user", "content": question})
        message = step(client, model, messages, "required")
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            result = run_tool(call)
            print(f"    tool {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        answer = step(client, model, messages, "none")
        messages.append({"role": "assistant", "content": answer.content or ""})
        print(f"    assistant: {(answer.content or '').strip()}")


if __name__ == "__main__":
    main()
