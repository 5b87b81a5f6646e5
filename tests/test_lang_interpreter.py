"""The interpreter against an in-process backend that implements the backend contract honestly.

The backend is a tiny deterministic "model": a greedy longest-match tokenizer over single
characters plus the merged token "is" (so token healing at the select boundary happens), and a
bigram log-softmax over that vocabulary. Generation is greedy decoding of that model with stop
strings and max_new_tokens; prefill returns real input logprobs; cached_tokens is the longest
token prefix shared with any earlier request. Real-runtime behaviour is in test_lang_runtime.py.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

import sgl_lite as sgl
from sgl_lite.lang.backend.base import BaseBackend, PrefillRequest
from sgl_lite.lang.chat_template import CHATML, ChatTemplate
from sgl_lite.lang.executor import ProgramError
from sgl_lite.lang.ir import SglSamplingParams

VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "is"]
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}


def tokenize(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        if text.startswith("is", i):
            ids.append(TOKEN_ID["is"])
            i += 2
        else:
            ids.append(TOKEN_ID[text[i]])
            i += 1
    return ids


def next_logprobs(prev: int) -> list[float]:
    scores = [math.sin(prev * 12.9898 + t * 78.233) * 6.0 for t in range(len(VOCAB))]
    top = max(scores)
    log_z = top + math.log(sum(math.exp(s - top) for s in scores))
    return [s - log_z for s in scores]


class BigramBackend(BaseBackend):
    def __init__(self, template: ChatTemplate = CHATML) -> None:
        self.template = template
        self.seen: list[list[int]] = []
        self.requests: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def get_chat_template(self) -> ChatTemplate:
        return self.template

    def _cached(self, ids: list[int]) -> int:
        with self.lock:
            best = 0
            for old in self.seen:
                n = 0
                while n < min(len(old), len(ids)) and old[n] == ids[n]:
                    n += 1
                best = max(best, n)
            self.seen.append(ids)
            return best

    def _decode(self, text: str, params) -> tuple[list[str], str]:
        ids = tokenize(text)
        pieces: list[str] = []
        out = ""
        stops = params.stop_list()
        prev = ids[-1] if ids else 0
        for _ in range(params.max_new_tokens):
            lp = next_logprobs(prev)
            prev = max(range(len(lp)), key=lp.__getitem__)
            piece = VOCAB[prev]
            joined = out + piece
            cut = min((joined.find(s) for s in stops if s in joined), default=-1)
            if cut >= 0:
                pieces.append(joined[len(out):cut])
                out = joined[:cut]
                break
            pieces.append(piece)
            out = joined
        return pieces, out

    def generate(self, text, params):
        self.requests.append(("generate", text))
        pieces, out = self._decode(text, params)
        prompt = tokenize(text)
        meta = {"prompt_tokens": len(prompt), "completion_tokens": len(pieces), "cached_tokens": self._cached(prompt),
                "finish_reason": {"type": "length"}}
        return out, meta

    def generate_stream(self, text, params):
        self.requests.append(("generate_stream", text))
        pieces, _ = self._decode(text, params)
        for i, piece in enumerate(pieces):
            time.sleep(0.001)
            yield piece, {"completion_tokens": i + 1}

    def prefill(self, requests: list[PrefillRequest]) -> list[dict]:
        out = []
        for r in requests:
            self.requests.append(("prefill", r.text))
            ids = list(r.input_ids) if r.input_ids is not None else tokenize(r.text)
            meta = {"prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": self._cached(ids)}
            if r.return_logprob:
                entries = []
                for pos in range(max(r.logprob_start_len, 0), len(ids)):
                    lp = None if pos == 0 else next_logprobs(ids[pos - 1])[ids[pos]]
                    entries.append([lp, ids[pos], None])
                meta["input_token_logprobs"] = entries
                meta["output_token_logprobs"] = []
            out.append(meta)
        return out

    def flush_cache(self) -> bool:
        self.seen.clear()
        return True

    def get_server_info(self) -> dict:
        return {"model_path": "bigram"}


def greedy(text: str, max_new_tokens: int, stop: tuple[str, ...] = ()) -> str:
    return BigramBackend()._decode(text, SglSamplingParams(max_new_tokens=max_new_tokens, stop=list(stop)))[1]


def expected_choice_logprobs(prefix: str, choice: str) -> list[float]:
    """Independent computation: logprobs of the tokens of prefix+choice that are not prefix tokens."""
    full, pre = tokenize(prefix + choice), tokenize(prefix)
    keep = len(pre) if full[: len(pre)] == pre else len(pre) - 1  # healing: the merged token counts
    return [next_logprobs(full[i - 1])[full[i]] for i in range(max(keep, 1), len(full))]


@pytest.fixture
def backend() -> BigramBackend:
    return BigramBackend()


def test_gen_appends_and_stores(backend):
    @sgl.function
    def prog(s, q):
        s += "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=5)
        s += "!"

    state = prog.run(q="hi", backend=backend)
    expected = greedy("Q: hi\nA:", 5)
    assert state["a"] == expected
    assert state.text() == "Q: hi\nA:" + expected + "!"
    assert state.get_meta_info("a")["prompt_tokens"] == len(tokenize("Q: hi\nA:"))


def test_stop_string_cuts_output(backend):
    @sgl.function
    def prog(s):
        s += "abc" + sgl.gen("x", max_tokens=40)

    full = prog.run(backend=backend)["x"]
    stop = full[3:5]
    cut = prog.run(backend=backend, stop=stop)["x"]
    assert cut == full[: full.find(stop)]


def test_roles_and_messages_follow_template(backend):
    @sgl.function
    def chat(s):
        s += sgl.system("be brief")
        s += sgl.user("hello")
        with s.assistant():
            s += "ok"

    state = chat.run(backend=backend)
    assert state.text() == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                            "<|im_start|>assistant\nok<|im_end|>\n")
    assert state.messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                                {"role": "assistant", "content": "ok"}]


def test_default_system_prompt_inserted(backend):
    backend.template = ChatTemplate("t", CHATML.role_prefix_and_suffix, default_system_prompt="DEFAULT")

    @sgl.function
    def chat(s):
        s += sgl.user_begin() + "hey" + sgl.user_end()

    state = chat.run(backend=backend)
    assert state.messages()[0] == {"role": "system", "content": "DEFAULT"}
    assert state.text().startswith("<|im_start|>system\nDEFAULT<|im_end|>\n<|im_start|>user\nhey")


def test_fork_join_gathers_lists_and_hints_prefix(backend):
    @sgl.function
    def prog(s):
        s += "Shared context. "
        forks = s.fork(3)
        forks += lambda i: f"Branch {i}:" + sgl.gen("b", max_tokens=3)
        forks.join()

    state = prog.run(backend=backend)
    assert len(state["b"]) == 3
    assert state["b"] == [greedy(f"Shared context. Branch {i}:", 3) for i in range(3)]
    assert ("prefill", "Shared context. ") in backend.requests


def test_nested_fork(backend):
    @sgl.function
    def prog(s):
        s += "root "
        outer = s.fork(2)
        for i, branch in enumerate(outer):
            branch += f"o{i} "
            inner = branch.fork(2)
            inner += lambda j: f"i{j}" + sgl.gen("leaf", max_tokens=2)
            inner.join()
        outer.join()

    state = prog.run(backend=backend)
    leaves = state["leaf"]
    assert len(leaves) == 2 and all(len(x) == 2 for x in leaves)


def test_a_finished_state_cannot_fork_and_starts_no_worker(backend):
    """run() ends the program's executor: a branch forked from it would start a worker thread nothing ends."""
    @sgl.function
    def prog(s):
        s += "done " + sgl.gen("a", max_tokens=2)

    state = prog.run(backend=backend)
    before = {t.name for t in threading.enumerate()}
    for size in (1, 2):
        with pytest.raises(RuntimeError, match="ended"):
            state.fork(size)
    assert not {t.name for t in threading.enumerate() if t.name.startswith("sgl-program")} - before
    assert state.text() == "done " + state["a"]


def test_nested_function_calls(backend):
    @sgl.function
    def greet(s, name):
        s += "Hello " + name + ". "

    @sgl.function
    def prog(s):
        s += greet("A")
        greet(s, "B")
        s += sgl.gen("x", max_tokens=2)

    state = prog.run(backend=backend)
    assert state.text().startswith("Hello A. Hello B. ")


def test_program_error_surfaces(backend):
    @sgl.function
    def bad(s):
        s += "x" + sgl.gen("a", max_tokens=2)
        raise ValueError("boom")

    # SGLang's behaviour: the caller of run() sees the program's own exception.
    with pytest.raises(ValueError, match="boom"):
        bad.run(backend=backend)

    @sgl.function
    def reads_then_raises(s):
        s += "x" + sgl.gen("a", max_tokens=2)
        if len(s["a"]) == 2:
            raise KeyError("no such tool")

    with pytest.raises(KeyError, match="no such tool"):
        reads_then_raises.run(backend=backend)

    # A streamed run has returned before the body raises: the error is on the state.
    state = bad.run(backend=backend, stream=True)
    for _ in state.text_iter():  # ends when the program has
        pass
    assert isinstance(state.error(), ValueError)
    assert len(state["a"]) == 2  # produced before the error

    @sgl.function
    def bad_expr(s):
        s += sgl.gen("a", max_tokens=2, n=3)  # n>1 unsupported: fails inside the worker
        s += sgl.gen("b", max_tokens=2)

    state = bad_expr.run(backend=backend)
    assert "n=3" in str(state.error())
    with pytest.raises(ProgramError):
        state["b"]


def test_var_scope_and_copy(backend):
    @sgl.function
    def prog(s):
        with s.var_scope("scope"):
            s += "inside " + sgl.gen("g", max_tokens=2)
        with s.copy() as c:
            c += "copy" + sgl.gen("c", max_tokens=1)

    state = prog.run(backend=backend)
    assert state["scope"] == "inside " + state["g"]
    assert len(state["c"]) == 1


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
@pytest.mark.parametrize("prefix", ["The answer i", "Pick one: "])
def test_select_scores_match_independent_computation(backend, method, prefix):
    choices = ["sun", "is it", "moon", "xyz"]

    @sgl.function
    def prog(s):
        s += prefix + sgl.select("c", choices=choices, choices_method=method)

    state = prog.run(backend=backend)
    per_choice = [expected_choice_logprobs(prefix, c) for c in choices]
    if method is sgl.token_length_normalized:
        scores = [sum(v) / len(v) for v in per_choice]
        assert state.get_meta_info("c")["normalized_prompt_logprobs"] == pytest.approx(scores)
        expected = choices[scores.index(max(scores))]
    elif method is sgl.unconditional_likelihood_normalized:
        scores = []
        for c, cond in zip(choices, per_choice):
            ids = tokenize(prefix + c)[-len(cond):]
            uncond = [0.0] + [next_logprobs(ids[i - 1])[ids[i]] for i in range(1, len(ids))]
            scores.append(sum(a - b for a, b in zip(cond, uncond)) / len(cond))
        expected = choices[scores.index(max(scores))]
    else:
        width = max(len(v) for v in per_choice)
        rows = [v + [sum(v) / len(v)] * (width - len(v)) for v in per_choice]
        alive = list(range(len(choices)))
        for col in range(width):
            top = max(rows[i][col] for i in alive)
            alive = [i for i in alive if rows[i][col] == top]
            if len(alive) == 1:
                break
        expected = choices[alive[0]]
    assert state["c"] == expected
    assert state.text() == prefix + expected


def test_gen_with_choices_is_select(backend):
    @sgl.function
    def prog(s):
        s += "x " + sgl.gen("c", choices=["a", "b"])

    assert prog.run(backend=backend)["c"] in ("a", "b")


def test_no_backend_is_a_clear_error():
    @sgl.function
    def prog(s):
        s += "x"

    sgl.set_default_backend(None)
    with pytest.raises(RuntimeError, match="set_default_backend"):
        prog.run()
