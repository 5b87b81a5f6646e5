"""Grammar matchers below the decode loop: batch masks, termination, rollback, spec validation and the compile cache."""

from __future__ import annotations

import concurrent.futures
import importlib.util
from pathlib import Path

import pytest
import torch
from test_grammar import PERSON_SCHEMA

from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.grammar import GrammarBackend, GrammarMatcher, apply_grammar_masks, grammar_key


def allowed_by_matcher(matcher: GrammarMatcher, vocab_size: int) -> set[int]:
    """Tokens the matcher accepts now, found by trying each one and rolling it back."""
    allowed = set()
    for tok in range(vocab_size):
        if matcher._matcher.accept_token(tok):
            allowed.add(tok)
            matcher.rollback(1)
    return allowed


def test_batch_mask_touches_only_constrained_rows(tiny_backend, tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    digits = tiny_backend.request_matcher(SamplingParams(regex=r"[0-9]{1,2}")).result()
    person = tiny_backend.request_matcher(SamplingParams(json_schema=PERSON_SCHEMA)).result()
    for tok in tiny_tokenizer.encode('{"name'):
        assert person.accept_token(tok)
    digits.accept_token(tiny_tokenizer.convert_tokens_to_ids("4"))
    width = tiny_backend.vocab_size + 8  # wider than the grammar's vocabulary too
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    matchers = [None, digits, None, None, person, None]
    apply_grammar_masks(logits, matchers)
    for row in (0, 2, 3, 5):
        assert torch.equal(logits[row], before[row])
    for row, matcher in ((1, digits), (4, person)):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == allowed_by_matcher(matcher, vocab)
        assert torch.equal(logits[row, sorted(finite)], before[row, sorted(finite)])
    assert tiny_tokenizer.eos_token_id in set(torch.isfinite(logits[1]).nonzero().flatten().tolist())


def test_terminated_matcher_allows_only_eos(tiny_backend, tiny_tokenizer):
    matcher = tiny_backend.request_matcher(SamplingParams(regex=r"7")).result()
    assert matcher.accept_token(tiny_tokenizer.convert_tokens_to_ids("7"))
    assert not matcher.is_terminated() and matcher.is_completed()
    assert matcher.accept_token(tiny_tokenizer.eos_token_id) and matcher.is_terminated()
    logits = torch.zeros(1, tiny_backend.vocab_size)
    apply_grammar_masks(logits, [matcher])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tiny_tokenizer.eos_token_id]


def test_rollback_and_reset(tiny_backend, tiny_tokenizer):
    matcher = tiny_backend.request_matcher(SamplingParams(regex=r"ab|ac")).result()
    a, b, c = (tiny_tokenizer.convert_tokens_to_ids(x) for x in "abc")
    assert matcher.accept_token(a) and matcher.accept_token(b) and matcher.is_completed()
    matcher.rollback(1)
    assert not matcher.is_completed() and matcher.accept_token(c)
    matcher.reset()
    assert not matcher.accept_token(c) and matcher.accept_token(a)


def test_not_a_matcher_is_a_clear_error(tiny_backend):
    future = tiny_backend.request_matcher(SamplingParams(regex="x"))
    with pytest.raises(TypeError, match="row 0"):
        apply_grammar_masks(torch.zeros(1, tiny_backend.vocab_size), [future])


@pytest.mark.parametrize(
    "field, value",
    [
        ("regex", "[a-"),
        ("regex", "(abc"),
        ("json_schema", "{not json"),
        ("json_schema", {"type": "no-such-type"}),
        ("ebnf", "root ::= undefined_rule"),
        ("ebnf", 'root ::= "a'),
        ("structural_tag", {"type": "structural_tag", "format": {"type": "no-such-format"}}),
        ("structural_tag", "{not json"),
    ],
)
def test_invalid_specs_are_named(tiny_backend, field, value):
    params = SamplingParams(**{field: value})
    if field in ("json_schema", "structural_tag"):
        tiny_backend.validate(params)  # a schema is converted with its compile, off the caller's thread
    else:
        with pytest.raises(ValueError, match=f"^invalid {field}: ") as info:
            tiny_backend.validate(params)
        assert ".cc:" not in str(info.value)
    with pytest.raises(ValueError, match=f"^invalid {field}: ") as info:
        tiny_backend.request_matcher(params).result(timeout=60)
    assert ".cc:" not in str(info.value)


def test_valid_specs_pass_validation(tiny_backend):
    for params in (SamplingParams(), SamplingParams(regex="a+"), SamplingParams(json_schema=PERSON_SCHEMA)):
        tiny_backend.validate(params)
    assert not GrammarBackend.is_constrained(SamplingParams())
    assert GrammarBackend.is_constrained(SamplingParams(ebnf='root ::= "a"'))


def test_compile_cache_reuses_one_compile(tiny_backend):
    with_dict = SamplingParams(json_schema={"type": "object", "properties": {"k": {"type": "integer"}}})
    with_text = SamplingParams(json_schema='{"type": "object",\n "properties": {"k": {"type": "integer"}}}')
    first = tiny_backend.request_matcher(with_dict).result()
    second = tiny_backend.request_matcher(with_text).result()
    assert first is not second  # each request has its own state...
    assert first._compiled is second._compiled  # ...over one compiled grammar
    assert tiny_backend.compiled_future(grammar_key(with_dict)) is tiny_backend.compiled_future(grammar_key(with_text))
    other = tiny_backend.request_matcher(SamplingParams(regex="k")).result()
    assert other._compiled is not first._compiled


def test_compile_runs_off_the_calling_thread(tiny_backend):
    params = SamplingParams(regex=r"[a-z]{1,3}-[0-9]{1,3}-off-thread")
    future = tiny_backend.request_matcher(params)
    assert isinstance(future, concurrent.futures.Future)
    assert isinstance(future.result(timeout=60), GrammarMatcher)


def test_mask_cost_benchmark_runs(tiny_tokenizer):
    spec = importlib.util.spec_from_file_location(
        "bench_grammar", Path(__file__).resolve().parents[1] / "scripts" / "bench_grammar.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.mask_cost_per_step(batch=4, steps=5, tokenizer=tiny_tokenizer)
    assert result["batch"] == 4 and result["fill_ms"] > 0 and result["apply_ms"] > 0
