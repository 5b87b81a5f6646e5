"""A ReAct-style agent over several turns with Python tools (calculator, lookup table).

The program itself is `sgl_lite.demo_agent.react_agent` (also what `sgl-lite demo` runs); this
script starts a runtime, runs the agent, and prints each turn with the prompt tokens the runtime
served from its prefix cache.

    python examples/multi_turn_agent.py [--model-path smollm2-135m] [--question "..."]
"""

from __future__ import annotations

import argparse

from sgl_lite.demo_agent import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="smollm2-135m")
    parser.add_argument("--question", default="How tall is the Eiffel Tower in millimeters?")
    args = parser.parse_args()
    main(model_path=args.model_path, question=args.question)
