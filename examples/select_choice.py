"""select: let the model choose among fixed options by their (normalized) likelihood.

(Named select_choice.py because a script named select.py would shadow the stdlib module `select`.)

    python examples/select_choice.py [--model-path smollm2-135m]
"""

from __future__ import annotations

import argparse

import sgl_lite as sgl


@sgl.function
def classify(s, sentence):
    s += sgl.user("Is the sentiment of this review positive or negative?\n" + sentence)
    s += sgl.assistant("The sentiment is " + sgl.select("label", choices=["positive", "negative"]))


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ", I need to use a "
    s += sgl.select("tool", choices=["calculator", "search engine"],
                    choices_method=sgl.unconditional_likelihood_normalized)
    s += ". "


def main() -> None:
    parser = argparse.ArgumentParser(description="select with the sgl_lite DSL")
    parser.add_argument("--model-path", default="smollm2-135m")
    args = parser.parse_args()
    reviews = ["I loved every minute of it, wonderful!", "Terrible food and rude staff. Never again."]
    with sgl.Runtime(model_path=args.model_path) as runtime:
        sgl.set_default_backend(runtime)
        for state, review in zip(classify.run_batch([(r,) for r in reviews]), reviews):
            scores = state.get_meta_info("label")["normalized_prompt_logprobs"]
            print(f"{review!r} -> {state['label']}  (mean logprobs {[round(x, 3) for x in scores]})")
        state = tool_use.run("What is 37 times 91?")
        print(f"tool: {state['tool']}")


if __name__ == "__main__":
    main()
