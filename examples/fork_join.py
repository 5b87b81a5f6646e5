"""Fork/join: expand several tips in parallel branches that share one prefilled prefix.

    python examples/fork_join.py [--model-path smollm2-135m]
"""

from __future__ import annotations

import argparse

import sgl_lite as sgl


@sgl.function
def tip_suggestion(s, topic):
    s += sgl.user_begin() + f"Here are two tips for {topic}: 1. Balanced diet. 2. Regular exercise.\n"
    forks = s.fork(2)  # the shared text is prefilled once before the branches start
    for i, f in enumerate(forks):
        f += f"Expand tip {i + 1} into one sentence." + sgl.user_end()
        f += sgl.assistant(sgl.gen("detail", max_tokens=48, stop="\n"))
    forks.join()
    s += "Now summarize both tips." + sgl.user_end()
    s += sgl.assistant(sgl.gen("summary", max_tokens=48))


def main() -> None:
    parser = argparse.ArgumentParser(description="fork/join with the sgl_lite DSL")
    parser.add_argument("--model-path", default="smollm2-135m")
    args = parser.parse_args()
    with sgl.Runtime(model_path=args.model_path) as runtime:
        sgl.set_default_backend(runtime)
        state = tip_suggestion.run("staying healthy", temperature=0)
        for i, (detail, meta) in enumerate(zip(state["detail"], state.get_meta_info("detail"))):
            print(f"tip {i + 1}: {detail.strip()}  (cached {meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens)")
        print(f"summary: {state['summary'].strip()}")
        if state.error() is not None:
            raise SystemExit(f"program failed: {state.error()!r}")


if __name__ == "__main__":
    main()
