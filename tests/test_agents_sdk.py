"""The OpenAI Agents SDK (`openai-agents`, not a test dependency: skipped where it is not installed) on its
default path, the Responses API, against a live server (tiny random model, smollm2-tools template, qwen25
parser) with two function tools. A random model calls a tool only when made to (`tool_choice` required); the
SDK then resets tool_choice; the tools are enabled until one has run (a random model would call again), so the
next turn answers with the agent's structured output (text.format: a bounded schema, so that the answer ends). Expected values come from the tools themselves and
from the server's stored responses."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field
from test_http import API_KEY, Live
from test_tools_http import live, tool_model_dir  # noqa: F401  (fixtures)

from sgl_lite.testing.kv_accounting import assert_idle_without_leaks

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)

CALLS: list[tuple[str, dict[str, Any]]] = []


def _until_one_ran(context: Any, agent: Any) -> bool:
    return not CALLS


@agents.function_tool(is_enabled=_until_one_ran)
def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["celsius", "fahrenheit"]) -> str:
    """Current weather of a city."""
    CALLS.append(("get_weather", {"city": city, "unit": unit}))
    return f"sunny in {city}"


@agents.function_tool(is_enabled=_until_one_ran)
def add(a: Annotated[int, Field(ge=-999, le=999)], b: Annotated[int, Field(ge=-999, le=999)]) -> str:
    """Add two integers."""
    CALLS.append(("add", {"a": a, "b": b}))
    return str(a + b)


class Answer(BaseModel):
    verdict: Literal["yes", "no", "maybe"]
    score: Annotated[int, Field(ge=0, le=99)]


def _agent(**settings: Any) -> Any:
    model_settings = agents.ModelSettings(temperature=0.0, max_tokens=200, parallel_tool_calls=False, **settings)
    return agents.Agent(name="assistant", instructions="You answer with the tools you are given.", model="tiny",
                        tools=[get_weather, add], model_settings=model_settings, output_type=Answer)


@pytest.fixture
def sdk(live: Live) -> Any:  # noqa: F811  (the fixture of test_tools_http)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=live.http.url + "/v1", api_key=API_KEY,
                                                        max_retries=0, timeout=300), use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_tracing_disabled(True)
    CALLS.clear()
    return agents


def test_a_required_tool_call_runs_the_tool_and_the_next_turn_answers(sdk: Any, live: Live) -> None:  # noqa: F811
    agent = _agent(tool_choice="required")
    result = asyncio.run(sdk.Runner.run(agent, "What is the weather in Paris, and what is 2 + 3?", max_turns=4,
                                        auto_previous_response_id=True))
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    name, arguments = CALLS[0]
    assert result.new_items[1].output == (f"sunny in {arguments['city']}" if name == "get_weather"
                                          else str(arguments["a"] + arguments["b"]))
    # The last turn answered (the SDK reset tool_choice after the call), chained by previous_response_id.
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, Answer)
    responses = [r.response_id for r in result.raw_responses]
    assert len(responses) >= 2 and all(r and r.startswith("resp_") for r in responses)
    stored = live.get(f"/v1/responses/{responses[-1]}").json()
    assert stored["previous_response_id"] == responses[-2] and stored["status"] in ("completed", "incomplete")
    assert_idle_without_leaks(live.client)


def test_stop_on_first_tool_ends_with_the_tool_output(sdk: Any, live: Live) -> None:  # noqa: F811
    agent = _agent(tool_choice="required").clone(tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(sdk.Runner.run(agent, "What is 2 + 3?", max_turns=2))
    assert len(CALLS) == 1 and result.final_output == result.new_items[1].output
    assert len(result.raw_responses) == 1
