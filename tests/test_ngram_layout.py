"""Layout-free n-gram lookup (speculative/ngram_layout.py): a copy laid out anew still drafts from its source."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.speculative.ngram_layout import WHITESPACE, LayoutFreeView, layout_free_keys
from sgl_lite.runtime.speculative.ngram_proposer import NgramProposer, suffix_match


class TextTokenizer:
    """A tokenizer whose token i decodes to texts[i]."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return ["".join(self.texts[i] for i in seq) for seq in ids]


# A JSON object inline in the prompt, pretty-printed in the answer.
TEXTS = ['{', ' "', '"', 'name', '":', 'beta', '",', 'id', '42', '}', '\n', '  ', ' ', '\ufffd', '\ufffd', 'x']
T = {text: i for i, text in enumerate(TEXTS) if text != '\ufffd'}
SOURCE = [T['{'], T['"'], T['name'], T['":'], T[' "'], T['beta'], T['",'], T[' "'], T['id'], T['":'], T[' '], T['42'], T['}']]
COPY = [T['{'], T['\n'], T['  '], T['"'], T['name'], T['":'], T[' "'], T['beta'], T['",'], T['\n'], T['  '], T['"']]


def req_with(prompt: list[int], output: list[int]) -> Req:
    req = Req(rid="r", input_ids=list(prompt), sampling_params=SamplingParams())
    req.output_ids = list(output)
    return req


def test_keys_ignore_whitespace_and_keep_partial_characters_apart() -> None:
    keys = layout_free_keys(TextTokenizer(TEXTS), vocab_size=len(TEXTS) + 2)
    assert keys[T[' "']] == keys[T['"']] != keys[T['",']]
    assert {keys[T['\n']], keys[T['  ']], keys[T[' ']]} == {WHITESPACE}
    partial = [i for i, text in enumerate(TEXTS) if text == '\ufffd']
    assert keys[partial[0]] != keys[partial[1]]  # two halves of different characters are not one key
    beyond = keys[len(TEXTS):]  # ids the model has and the tokenizer does not: a key each
    assert len(set(beyond.tolist()) | set(keys[: len(TEXTS)].tolist())) == len(set(keys[: len(TEXTS)].tolist())) + 2
    assert layout_free_keys(None, 10) is None


def test_a_copy_laid_out_anew_drafts_the_source_after_the_matched_position() -> None:
    keys = layout_free_keys(TextTokenizer(TEXTS), len(TEXTS))
    req = req_with(SOURCE, COPY)
    # Exactly, the copy's last tokens ('\n', '  ', '"') occur nowhere before as a run longer than one token.
    exact = NgramProposer(8, 1, 12).lookup(req_with(SOURCE, COPY), 8)[0]
    draft, from_pool = NgramProposer(8, 1, 12, layout_keys=keys).lookup(req, 8)
    # Layout-free, the copy ends with `"beta", "` like the source before `id`: the draft is the source's
    # tokens from there on, which the model, laying out as it does, accepts up to the next line break.
    assert draft == [T['id'], T['":'], T[' '], T['42'], T['}']] + COPY[:3] and not from_pool
    assert len(exact) <= 1 or exact != draft


def test_one_key_alone_drafts_nothing_layout_free() -> None:
    keys = layout_free_keys(TextTokenizer(TEXTS), len(TEXTS))
    # the last key ('x') occurs before, but only that one: no layout-free draft, and no exact one of two
    prompt = [T['x'], T['42'], T['{']]
    draft, _ = NgramProposer(8, 2, 12, layout_keys=keys).lookup(req_with(prompt, [T['beta'], T['x']]), 8)
    assert draft == []


def brute_force_start(tokens: list[int], keys: np.ndarray, min_len: int, max_len: int) -> int | None:
    """Where the layout-free draft starts: after the latest earlier occurrence of the longest key suffix."""
    kept = [(keys[t], i) for i, t in enumerate(tokens) if keys[t] != WHITESPACE]
    seq = [k for k, _ in kept]
    for n in range(min(max_len, len(seq) - 1), min_len - 1, -1):
        for end in range(len(seq) - 1, n - 1, -1):
            if seq[end - n : end] == seq[len(seq) - n :]:
                return kept[end - 1][1] + 1
    return None


def test_layout_free_draft_starts_where_brute_force_says() -> None:
    rng = random.Random(0)
    texts = ['a', 'b', 'c', ' a', 'b ', ' ', '\n', 'd']
    keys = layout_free_keys(TextTokenizer(texts), len(texts))
    layout_drafts = 0
    for _ in range(300):
        prompt = [rng.randrange(len(texts)) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(len(texts)) for _ in range(rng.randrange(1, 30))]
        tokens = prompt + output
        req = req_with(prompt, output)
        proposer = NgramProposer(6, 1, 4, layout_keys=keys)
        exact = NgramProposer(6, 1, 4).lookup(req_with(prompt, output), 6)[0]
        draft = proposer.lookup(req, 6)[0]
        own = suffix_match(np.array(tokens), 1, 4)
        if own is not None and own[1] == 4:
            assert draft == exact
            continue
        start = brute_force_start(tokens, keys, max(2, 1 + (0 if own is None else own[1])), 4)
        assert draft == (exact if start is None else tokens[start : start + 6])
        layout_drafts += draft != exact
    assert layout_drafts > 30  # the layout-free lookup decided many of them


def test_the_view_grows_with_the_request() -> None:
    keys = np.array([0, WHITESPACE, 1, 2])
    view = LayoutFreeView()
    assert [a.tolist() for a in view.update(np.array([0, 1, 2]), keys)] == [[0, 1], [0, 2]]
    assert [a.tolist() for a in view.update(np.array([0, 1, 2, 1, 3]), keys)] == [[0, 1, 2], [0, 2, 4]]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path):
    common = dict(model_path=str(tiny_llama_dir), max_total_tokens=4096, max_running_requests=4, log_level="warning")
    plain, speculating = Engine(**common), Engine(**common, speculative_algorithm="ngram", speculative_ngram_capacity=0)
    yield plain, speculating
    plain.shutdown()
    speculating.shutdown()


def test_the_runtime_drafts_layout_free_and_keeps_greedy_output(engines) -> None:
    plain, speculating = engines
    assert speculating.core.scheduler.proposer.layout_keys is not None  # built from the served tokenizer
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    prompts = ['{"name": "beta", "id": 42, "status": "ok"} {\n  "name": "beta",\n  "', "one two three one two three"]
    for prompt in prompts:
        assert speculating.generate(prompt, params)["output_ids"] == plain.generate(prompt, params)["output_ids"]
    for engine in engines:
        engine.core.scheduler.check_invariant()
        assert not engine.core.scheduler.has_work()
