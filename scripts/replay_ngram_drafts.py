"""How many tokens per step n-gram drafts could give on bench_speculative's copy workload, whatever they cost.

Greedy output does not depend on speculation, so each prompt's output is generated once (speculation
off) and the drafting is replayed offline: at every step the drafter proposes from the prompt and the
output so far, the draft is accepted up to its first token that differs from the real output, and the
step yields that many tokens plus one. Drafters compared, each with up to --cap tokens, every step
drafting (no cost model, so an upper bound of what the runtime's policy can reach):
- latest: the runtime's lookup in the request's own tokens (ngram_proposer.suffix_match: the latest
  match of the longest suffix);
- latest + pool: the runtime's lookup with its shared pool of earlier outputs (NgramProposer.lookup, at
  the server's --speculative-ngram-capacity; the prompts run one after another, each output joining the
  pool when it ends);
- latest + pool + layout: the same with the runtime's layout-free lookup as well (ngram_layout.py: tokens
  keyed by their text without whitespace, so that a copy laid out anew still matches its source);
- best of 2 / best of all: an oracle picking, among the two latest / all earlier matches of that
  suffix, the one that would be accepted longest (what a verifier of several drafts at once could reach).
Usage: python scripts/replay_ngram_drafts.py [--prompts 8] [--max-new-tokens 64] [--caps 4 8 12]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import chat, copy_prompts  # noqa: E402

from sgl_lite.runtime.managers.request import Req  # noqa: E402
from sgl_lite.runtime.protocol import SamplingParams  # noqa: E402
from sgl_lite.runtime.server.engine import Engine  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402
from sgl_lite.runtime.speculative.ngram_layout import layout_free_keys  # noqa: E402
from sgl_lite.runtime.speculative.ngram_proposer import NgramProposer, suffix_match  # noqa: E402

MIN_WINDOW, MAX_WINDOW = 1, 12  # the server's defaults (--speculative-ngram-{min,max}-match-window-size)


def earlier_matches(tokens: np.ndarray) -> list[int]:
    """End positions of every earlier occurrence of the longest matching suffix, latest first."""
    length = tokens.shape[0]
    for n in range(min(MAX_WINDOW, length - 1), MIN_WINDOW - 1, -1):
        suffix = tokens[length - n :]
        ends = [e for e in range(n, length) if np.array_equal(tokens[e - n : e], suffix)]
        if ends:
            return ends[::-1]
    return []


def accepted(draft: list[int], output: list[int], pos: int) -> int:
    count = 0
    while count < len(draft) and pos + count < len(output) and draft[count] == output[pos + count]:
        count += 1
    return count


def replay(pairs: list[tuple[list[int], list[int]]], cap: int, drafter: str, layout_keys: np.ndarray | None) -> tuple[int, int]:
    """(output tokens, steps) over all (prompt, output) pairs."""
    tokens_total = steps = 0
    proposer = NgramProposer(cap, MIN_WINDOW, MAX_WINDOW, ServerArgs.speculative_ngram_capacity,
                             layout_keys if drafter == "latest + pool + layout" else None)
    for prompt, output in pairs:
        pos = 0
        req = Req(rid="replay", input_ids=list(prompt), sampling_params=SamplingParams())
        while pos < len(output):
            tokens = np.array(prompt + output[:pos], dtype=np.int64)
            if drafter.startswith("latest + pool"):
                req.output_ids = output[:pos]
                drafts = [proposer.lookup(req, cap)[0]]
            elif drafter == "latest":
                match = suffix_match(tokens, MIN_WINDOW, MAX_WINDOW)
                drafts = [] if match is None else [tokens[match[0] : match[0] + cap].tolist()]
            else:
                ends = earlier_matches(tokens)[: 2 if drafter == "best of 2" else None]
                drafts = [tokens[e : e + cap].tolist() for e in ends]
            best = max((accepted(draft, output, pos) for draft in drafts), default=0)
            step = min(best + 1, len(output) - pos)
            pos, steps, tokens_total = pos + step, steps + 1, tokens_total + step
        req.output_ids = list(output)
        proposer.remember(req)
    return tokens_total, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--caps", type=int, nargs="+", default=[4, 8, 12])
    args = parser.parse_args()
    engine = Engine(model_path=args.model, log_level="warning")
    tokenizer = engine.core.tokenizer
    layout_keys = layout_free_keys(tokenizer, len(tokenizer))
    prompts = [chat(engine, [{"role": "user", "content": p}]) + tokenizer(start, add_special_tokens=False)["input_ids"]
               for p, start in copy_prompts(args.prompts)]
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": args.max_new_tokens})
    engine.shutdown()
    pairs = [(p, o["output_ids"]) for p, o in zip(prompts, outs)]
    print(f"copy workload: {len(pairs)} prompts, {sum(len(o) for _, o in pairs)} output tokens (greedy)")
    print("| draft cap | drafter | steps | tokens per step |")
    print("|---:|---|---:|---:|")
    for cap in args.caps:
        for drafter in ("latest", "latest + pool", "latest + pool + layout", "best of 2", "best of all"):
            tokens, steps = replay(pairs, cap, drafter, layout_keys)
            print(f"| {cap} | {drafter} | {steps} | {tokens / steps:.2f} |")


if __name__ == "__main__":
    main()
