"""Jump-forward decoding on the default model: greedy output is the same as without jump-forward wherever
the model's own tokens agree with the retokenized ones, and the same up to the first jump where they do
not (the cases and helpers are test_jump_forward.py's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_jump_forward import CASES, accept_all, assert_idle_without_leaks, constraint_of, ids_of

from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.grammar import GrammarBackend, GrammarMatcher
from sgl_lite.runtime.sampling.jump_forward import RETOKENIZE_TAIL_TOKENS, JumpForward
from sgl_lite.runtime.server.engine import Engine


def first_disagreement(finder: JumpForward, matcher: GrammarMatcher, input_ids: list[int], output_ids: list[int]) -> int | None:
    """Replay a run WITHOUT jump-forward through the scheduler's jump rule: at each decode step (after the
    first token), the jump found from the output so far. Returns the output index where a jump's
    tokens first differ from the model's own (the runs may part there), or None when all agree (then
    the model reads the same tokens in both runs, and greedy output must be the same)."""
    n, settled = 1, 0
    accept_all(matcher, output_ids[:1])
    while n < len(output_ids):
        jump = finder.find(matcher, input_ids, output_ids[:n], floor=settled)
        if jump is not None:
            end = jump.keep + len(jump.tokens)
            if output_ids[jump.keep:end] != jump.tokens:
                return jump.keep
            accept_all(matcher, output_ids[n:end])
            settled = max(settled, max(n, end) - RETOKENIZE_TAIL_TOKENS)
            n = end
            if n >= len(output_ids):
                break
        accept_all(matcher, output_ids[n : n + 1])  # the token sampled after it
        n += 1
    return None


@pytest.fixture(scope="module")
def default_engines(default_model_dir: Path):
    common = dict(model_path=str(default_model_dir), max_total_tokens=8192, max_running_requests=4, dtype="float32")
    on, off = Engine(**common), Engine(**common, disable_regex_jump_forward=True)
    yield on, off
    for engine in (on, off):
        engine.shutdown()


# Sentences whose forced words the default model, decoding them under the mask, writes as the tokenizer does.
NATURAL_REGEXES = [("What is the capital of France?", r"The capital of France is (Paris|London|Berlin)\."),
                   ("Is the sky blue? Answer yes or no, then explain in one sentence.", r"(Yes|No), the sky is [a-z ]{1,40}\.")]
NATURAL_CASES = [(f"sentence{i}", {"regex": regex}, prompt, lambda text, regex=regex: re.fullmatch(regex, text) is not None)
                 for i, (prompt, regex) in enumerate(NATURAL_REGEXES)]


def test_greedy_output_is_the_same_wherever_the_models_tokens_agree(default_engines) -> None:
    """Under a mask, the model often spells forced text in odd pieces (`{` `"` `custom` `er` where the
    tokenizer writes `{"` `customer`); a jump writes the tokenizer's pieces, the model then reads other
    tokens and may continue differently (both outputs valid). Where it spelled them as the tokenizer does,
    it reads the same tokens in both runs and the output is the same."""
    on, off = default_engines
    tokenizer = on.core.tokenizer
    backend = GrammarBackend(tokenizer, on.core.runner.vocab_size, eos_token_ids=on.core.eos_token_ids)
    finder = JumpForward(tokenizer)
    agreed = parted = 0
    for case in CASES + NATURAL_CASES:
        name, _, prompt, valid = case
        params = {"temperature": 0, "max_new_tokens": 160, **constraint_of(case)}
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        input_ids = ids_of(tokenizer, ids)
        jumped, plain = on.generate(input_ids=input_ids, sampling_params=params), off.generate(input_ids=input_ids, sampling_params=params)
        assert valid(jumped["text"]) and valid(plain["text"]), (name, jumped["text"], plain["text"])
        matcher = backend.request_matcher(SamplingParams(**constraint_of(case))).result(timeout=120)
        parting = first_disagreement(finder, matcher, input_ids, plain["output_ids"])
        assert jumped["meta_info"]["jump_forward_tokens"] > 0, name
        if parting is None:
            agreed += 1
            assert jumped["output_ids"] == plain["output_ids"] and jumped["text"] == plain["text"], name
        else:  # a legitimate difference: the same text up to there, then each run follows its own tokens
            parted += 1
            assert jumped["output_ids"][:parting] == plain["output_ids"][:parting], name
            assert jumped["output_ids"][parting:] != plain["output_ids"][parting:], name
    backend.shutdown()
    assert agreed >= 1 and parted >= 1, (agreed, parted)
    assert_idle_without_leaks(on, off)
