"""N-gram speculative decoding of constrained requests: drafts cut where the grammar forbids a token,
each verified position masked with the grammar's state there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.grammar import apply_draft_grammar_masks, apply_grammar_masks
from sgl_lite.runtime.server.engine import Engine

# Tests of verification, not of the draft-length policy (conftest.py).
pytestmark = pytest.mark.usefixtures("draft_lengths_from_the_prior")

DIGITS = r"[0-9]{3}-[0-9]{3}"


def test_allowed_prefix_and_draft_masks_leave_the_matcher_where_it_was(tiny_backend, tiny_tokenizer) -> None:
    matcher = tiny_backend.request_matcher(SamplingParams(regex=DIGITS)).result()
    ids = lambda text: tiny_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    good, bad = ids("123-4"), ids("12a")
    assert matcher.allowed_prefix(good) == len(good)
    assert matcher.allowed_prefix(bad) == len(ids("12"))  # cut at the first forbidden token
    vocab = tiny_backend.vocab_size
    logits = torch.zeros(len(good) + 1, vocab)
    apply_draft_grammar_masks(logits, matcher, good)
    # Row j is exactly the mask plain decoding applies after the draft's first j tokens.
    for j in range(len(good) + 1):
        row = torch.zeros(1, vocab)
        apply_grammar_masks(row, [matcher])
        assert torch.equal(torch.isinf(logits[j]), torch.isinf(row[0])), j
        if j < len(good):
            assert matcher.accept_token(good[j])
    matcher.rollback(len(good))
    assert matcher.allowed_prefix(good) == len(good)  # the state is back at the start
    with pytest.raises(ValueError, match="not allowed"):
        apply_draft_grammar_masks(torch.zeros(len(bad) + 1, vocab), matcher, bad)
    assert matcher.allowed_prefix(good) == len(good)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "id": {"type": "integer"}},
          "required": ["name", "id"]}
PROMPTS = ['Return {"name":"alpha","id":42} as {"name":"alpha","id":42} and {"name":"alpha","id":4',
           "number 123-456 then 123-456 and 123-4"]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path):
    common = dict(model_path=str(tiny_llama_dir), max_total_tokens=4096, max_running_requests=8,
                  dtype="float32", device="cpu")
    plain, spec = Engine(**common), Engine(**common, speculative_algorithm="ngram")
    yield plain, spec
    for eng in (plain, spec):
        eng.shutdown()


def check_idle(*engines: Engine) -> None:
    for eng in engines:
        eng.core.scheduler.check_invariant()  # the no-leak invariant (testing/kv_accounting.py's, in process)
        assert not eng.core.scheduler.has_work()


def test_greedy_constrained_output_is_identical_with_speculation(engines) -> None:
    plain, spec = engines
    cases = [(PROMPTS[0], {"json_schema": json.dumps(SCHEMA)}), (PROMPTS[1], {"regex": DIGITS})]
    verified = 0
    for prompt, constraint in cases:
        params = {"temperature": 0, "max_new_tokens": 48, **constraint}
        want, got = plain.generate(prompt, params), spec.generate(prompt, params)
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], constraint
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        verified += got["meta_info"].get("spec_verify_ct", 0)
    assert re.fullmatch(DIGITS, spec.generate(PROMPTS[1], {"temperature": 0, "regex": DIGITS})["text"])
    assert verified > 0  # constrained requests did draft
    # Batched with an unconstrained request: every row keeps its own output.
    batch = spec.generate(PROMPTS, [{"temperature": 0, "max_new_tokens": 32, "regex": DIGITS},
                                    {"temperature": 0, "max_new_tokens": 32}])
    assert [b["output_ids"] for b in batch] == [plain.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 32, "regex": DIGITS})["output_ids"],
                                                plain.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 32})["output_ids"]]
    check_idle(plain, spec)


def test_sampled_constrained_output_still_matches_the_grammar(engines) -> None:
    _, spec = engines
    for seed in range(6):
        out = spec.generate(PROMPTS[1], {"temperature": 1.0, "seed": seed, "max_new_tokens": 16, "regex": DIGITS})
        assert re.fullmatch(DIGITS, out["text"]), out["text"]
        out = spec.generate(PROMPTS[0], {"temperature": 0.8, "seed": seed, "max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)})
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert set(json.loads(out["text"])) == {"name", "id"}
    check_idle(spec)
