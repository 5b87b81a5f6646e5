"""A ReAct-style agent written in the DSL: the model thinks, calls Python tools, reads observations.

Each turn the assistant writes `Thought: ...` and then an `Action: tool[argument]` line whose shape
is enforced by a regex constraint, so even a small model always produces an action this code can
parse (the first action must call a tool, the last must answer). The tool's result comes back as the next user message. Every turn resends the whole
conversation; the runtime's radix cache makes the repeated part free, which the per-turn
cached_tokens / prompt_tokens numbers show.

`main()` is what `sgl-lite demo` runs: it starts a runtime on the default model.
"""

from __future__ import annotations

import ast
import operator
import re
import time
from typing import Any, Callable

import sgl_lite as sgl

LOOKUP_TABLE = {
    "population of france": "68 million",
    "population of belgium": "11.8 million",
    "capital of france": "Paris",
    "capital of belgium": "Brussels",
    "height of the eiffel tower": "330 meters",
    "boiling point of water": "100 degrees Celsius",
}

_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.Pow: operator.pow, ast.Mod: operator.mod}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        right = _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _BINARY_OPS[type(node.op)](_evaluate(node.left), right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("only numbers and + - * / % ** are allowed")


def calculator(expression: str) -> str:
    """Arithmetic on numbers (no names, no calls: safe to run on model output)."""
    try:
        value = _evaluate(ast.parse(expression.replace(",", ""), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e or 'invalid expression'}"
    return f"{value:.6g}"


def lookup(key: str) -> str:
    """Facts from a small table; unknown keys get the list of known ones."""
    value = LOOKUP_TABLE.get(key.strip().lower())
    if value is None:
        return "unknown key; known keys: " + ", ".join(LOOKUP_TABLE)
    return value


TOOLS: dict[str, Callable[[str], str]] = {"calculator": calculator, "lookup": lookup}
# The constraint the model's action line is generated under, and the parser of that line.
_ARGUMENT_REGEX = r"\[[A-Za-z0-9 .+*/()%-]{1,32}\]"
# The closing bracket is optional: generation can still end at max_tokens inside the argument.
ACTION_PATTERN = re.compile(r"(calculator|lookup|finish)\[([^\]]*)\]?")


def action_regex(turn: int, max_turns: int) -> str:
    """The first action must consult a tool, the last must answer: every run has 2+ turns and ends."""
    if turn == max_turns - 1:
        tools = "finish"
    elif turn == 0:
        tools = "calculator|lookup"
    else:
        tools = "calculator|lookup|finish"
    return f"({tools})" + _ARGUMENT_REGEX


SYSTEM_PROMPT = (
    "You answer questions with tools. Each reply is one line 'Thought: ...' and one line 'Action: ...'.\n"
    "Actions: lookup[key] reads a fact, calculator[expression] does arithmetic, finish[answer] ends.\n"
    "Known lookup keys: " + ", ".join(LOOKUP_TABLE) + "."
)
EXAMPLE = [
    ("user", "Question: How tall is the Eiffel Tower in centimeters?"),
    ("assistant", "Thought: I need the height first.\nAction: lookup[height of the eiffel tower]"),
    ("user", "Observation: 330 meters"),
    ("assistant", "Thought: 330 meters is 330 * 100 centimeters.\nAction: calculator[330 * 100]"),
    ("user", "Observation: 33000"),
    ("assistant", "Thought: I have the answer.\nAction: finish[33000 centimeters]"),
]


@sgl.function
def react_agent(s, question: str, max_turns: int = 4, echo: Callable[[str], Any] = print,
                max_thought_tokens: int = 40):
    if max_turns < 2:
        raise ValueError(f"max_turns must be >= 2 (a tool call, then an answer); got {max_turns}")
    s += sgl.system(SYSTEM_PROMPT)
    for role, content in EXAMPLE:
        s += getattr(sgl, role)(content)
    s += sgl.user("Question: " + question)
    for turn in range(max_turns):
        with s.assistant():
            s += "Thought:" + sgl.gen(f"thought_{turn}", max_tokens=max_thought_tokens, stop="\n") + "\nAction: "
            s += sgl.gen(f"action_{turn}", max_tokens=48, regex=action_regex(turn, max_turns))
        match = ACTION_PATTERN.fullmatch(s[f"action_{turn}"].strip())
        if match is None:  # cannot happen under the regex constraint unless the runtime ignored it
            raise ValueError(f"unparseable action {s[f'action_{turn}']!r}")
        tool, argument = match.group(1), match.group(2)
        meta = s.get_meta_info(f"thought_{turn}")
        echo(f"[turn {turn + 1}] Thought:{s[f'thought_{turn}']}")
        echo(f"[turn {turn + 1}] Action: {tool}[{argument}]   "
             f"(prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from cache)")
        if tool == "finish":
            s["answer"] = argument
            return
        observation = TOOLS[tool](argument)
        echo(f"[turn {turn + 1}] Observation: {observation}")
        s += sgl.user("Observation: " + observation)


def prompt_cache_stats(state: Any) -> tuple[int, int]:
    """(cached, prompt) tokens summed over every gen of an agent run."""
    cached = prompt = 0
    for name in list(state.stream_executor.meta_info):
        meta = state.get_meta_info(name)
        if isinstance(meta, dict) and "prompt_tokens" in meta:
            cached += meta["cached_tokens"]
            prompt += meta["prompt_tokens"]
    return cached, prompt


def run_agent(backend: Any, question: str, max_turns: int = 4, echo: Callable[[str], Any] = print) -> Any:
    state = react_agent.run(question, max_turns=max_turns, echo=echo, backend=backend, temperature=0)
    if state.error() is not None:
        raise RuntimeError(f"the agent program failed: {state.error()!r}") from state.error()
    cached, prompt = prompt_cache_stats(state)
    echo(f"answer: {state['answer']}")
    if prompt:
        echo(f"prompt tokens served from the prefix cache in this run: {cached}/{prompt} ({cached / prompt:.0%})")
    return state


def main(model_path: str = "smollm2-135m",
         question: str = "How tall is the Eiffel Tower in millimeters?") -> None:
    started = time.perf_counter()
    with sgl.Runtime(model_path=model_path) as runtime:
        print(f"runtime ready on {model_path} in {time.perf_counter() - started:.1f} s")
        print(f"Question: {question}")
        t0 = time.perf_counter()
        run_agent(runtime, question)
        info = sgl.get_server_info(runtime)
        print(f"agent finished in {time.perf_counter() - t0:.1f} s; runtime-reported cache hit rate: "
              f"{info.get('cache_hit_rate', 0.0):.0%}")


if __name__ == "__main__":
    main()
