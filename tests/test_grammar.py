r"""Constrained decoding (runtime/grammar.py): masks driven by random logits must only ever produce
outputs that match the constraint, leave unconstrained rows alone, and reject bad specs by name.

The decode loops below stand in for the model: each step draws random logits (seeded), masks them
with apply_grammar_masks, samples (greedy or with a temperature) and feeds the token back to the
matcher, until the matcher terminates (it accepted EOS after a complete match). A random walk over an
unbounded grammar (`[0-9]+`, `"[\w\d\s]*"`) may never end; after FORCE_EOS_AFTER steps the loop picks
EOS whenever the mask allows it, else an allowed token that makes the output a complete match if one
is among the likeliest (never a token the mask forbids, so matches are still the grammar's own).
The JSON schemas bound every string, array and integer so that they terminate on their own.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from sgl_lite.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.grammar import GrammarBackend, GrammarMatcher, apply_grammar_masks, grammar_key
from sgl_lite.runtime.sampling.grammar_backend import json_schema_ebnf

FORCE_EOS_AFTER = 48
MAX_STEPS = 400

EMAIL_REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
UNICODE_REGEX = r"(café|東京|Привет) [A-Z][a-z]{0,5}!"
REGEXES = [
    REGEX_INT,  # what gen(dtype=int / float / bool / str) sends (SGLang's regexes)
    REGEX_FLOAT,
    REGEX_BOOL,
    REGEX_STR,
    r"[0-9]{1,4}",
    r"(yes|no|maybe)",
    EMAIL_REGEX,
    r"\d{3}-\d{4}",
    UNICODE_REGEX,
    r'\{"name": "[A-Za-z ]{1,10}", "age": [0-9]{1,2}\}',
]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": -5, "maximum": 5},
            "minItems": 1,
            "maxItems": 4,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "scores"],
}

# Short enough for a few dozen decode steps of the tiny model (end-to-end test).
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        "child": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    },
    "required": ["id", "kind", "tags", "child"],
}


def finishing_token(matcher: GrammarMatcher, masked_logits: torch.Tensor, eos: int) -> int | None:
    """EOS when allowed, else the first of the 16 likeliest allowed tokens that makes the output a complete match."""
    if torch.isfinite(masked_logits[eos]):
        return eos
    candidates = masked_logits.topk(min(16, masked_logits.numel())).indices.tolist()
    for token in candidates:
        if torch.isfinite(masked_logits[token]) and matcher.accept_token(token):
            completes = matcher.is_completed()
            matcher.rollback(1)
            if completes:
                return token
    return None


def decode_walk(backend: GrammarBackend, tokenizer, params: SamplingParams, seed: int, temperature: float) -> str:
    """Generate with random logits under the constraint; return the text before EOS."""
    matcher = backend.request_matcher(params).result(timeout=60)
    eos = tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    output: list[int] = []
    for step in range(MAX_STEPS):
        logits = torch.randn(1, backend.vocab_size, generator=generator) * 4.0
        apply_grammar_masks(logits, [matcher])
        forced = finishing_token(matcher, logits[0], eos) if step >= FORCE_EOS_AFTER else None
        if forced is not None:
            token = forced
        elif temperature == 0.0:
            token = int(logits[0].argmax())
        else:
            # Exponential race, a draw from softmax(logits / T) (torch.multinomial is slow on a 49k vocabulary).
            probs = torch.softmax(logits[0] / temperature, dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-30)
            token = int((probs / noise).argmax())
        assert matcher.accept_token(token), f"the grammar rejected token {token}, which its own mask allowed"
        if matcher.is_terminated():
            assert token == eos
            return tokenizer.decode(output, clean_up_tokenization_spaces=False)
        output.append(token)
    raise AssertionError(f"no termination in {MAX_STEPS} steps: {tokenizer.decode(output)!r}")


def as_xgrammar_reads(regex: str) -> str:
    """`regex` for Python's re as xgrammar reads it: xgrammar 0.2.9 takes `\\s` as ECMAScript does, U+FEFF
    included (Python's `\\s` leaves it out). The regexes here use `\\s` only inside a character class."""
    return regex.replace(r"\s", "\\s\ufeff")


@pytest.mark.parametrize("regex", REGEXES)
def test_random_walks_full_match_regex(tiny_backend, tiny_tokenizer, regex):
    for seed in range(12):
        for temperature in (0.0, 0.7, 1.5):
            text = decode_walk(tiny_backend, tiny_tokenizer, SamplingParams(regex=regex), seed, temperature)
            assert re.fullmatch(as_xgrammar_reads(regex), text), f"seed {seed} T={temperature}: {text!r} does not match {regex!r}"


def test_int_regex_gives_ints(tiny_backend, tiny_tokenizer):
    values = set()
    for seed in range(20):
        text = decode_walk(tiny_backend, tiny_tokenizer, SamplingParams(regex=REGEX_INT), seed, 1.0)
        values.add(int(text.strip()))
    assert len(values) > 1  # random logits explore, not one forced answer


@pytest.mark.parametrize("as_string", [False, True])
def test_random_walks_json_schema_validate(tiny_backend, tiny_tokenizer, as_string):
    schema = json.dumps(PERSON_SCHEMA) if as_string else PERSON_SCHEMA
    params = SamplingParams(json_schema=schema)
    for seed in range(10):
        for temperature in (0.0, 1.0):
            text = decode_walk(tiny_backend, tiny_tokenizer, params, seed, temperature)
            document = json.loads(text)
            jsonschema.validate(document, PERSON_SCHEMA)
            assert list(document)[:2] == ["name", "age"]  # properties come in schema order


def test_json_strings_reject_raw_control_characters(tiny_backend):
    """xgrammar 0.2.8 lets a raw tab into a maxLength string; our compiled schema must not."""
    import xgrammar

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    bad, good = '{"s": "a\tb"}', '{"s": "ab"}'
    upstream = xgrammar.GrammarCompiler(tiny_backend.tokenizer_info, max_threads=1).compile_json_schema(
        schema, any_whitespace=False
    )
    ours = tiny_backend.compiled_future(grammar_key(SamplingParams(json_schema=schema))).result()

    def accepts(compiled, text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()

    assert accepts(ours, good) and not accepts(ours, bad)
    if accepts(upstream, bad):  # the upstream bug our EBNF rewrite works around is still there
        assert json_schema_ebnf(json.dumps(schema)) != str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))


def test_ebnf_walks(tiny_backend, tiny_tokenizer):
    ebnf = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c] | "x" [0-9]'
    for seed in range(10):
        text = decode_walk(tiny_backend, tiny_tokenizer, SamplingParams(ebnf=ebnf), seed, 1.0)
        assert re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9])){0,3}\)", text), text


@pytest.mark.parametrize("parser_name", ["qwen25", "llama3", "mistral", "hermes"])
@pytest.mark.parametrize("choice", ["required", "named", "auto", "none"])
def test_random_walks_under_the_tool_call_structural_tags(tiny_backend, tiny_tokenizer, choice, parser_name):
    """The structural tags the HTTP front sends for tools: whatever the logits, every call is whole and valid."""
    from sgl_lite.http.openai_api.tool_parsers import PARSERS
    from sgl_lite.http.openai_api.tools import ToolRequest

    tools = [{"type": "function", "function": {"name": "person", "parameters": PERSON_SCHEMA}}]
    fmt = PARSERS[parser_name]
    request = ToolRequest(tools, choice, "person" if choice == "named" else None, True, fmt, True)
    params = SamplingParams(structural_tag=request.structural_tag())
    for seed in range(6):
        text = decode_walk(tiny_backend, tiny_tokenizer, params, seed, 1.0)
        parsed = request.parser().parse(text)
        if choice in ("required", "named"):
            assert parsed.calls and parsed.content == "", text
        if choice == "none":
            assert fmt.call_trigger not in text
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), PERSON_SCHEMA)
        assert fmt.call_trigger not in parsed.content  # a started call always completed


def _smollm2_tokenizer():
    loader = pytest.importorskip("sgl_lite.runtime.model_executor.loader", reason="runtime/loader.py has not landed yet")
    return loader.load_tokenizer(loader.resolve_model_path("smollm2-135m"))


@pytest.mark.default_model
def test_smollm2_tokenizer_walks():
    """The real 49k byte-level vocabulary (multi-character, space-prefixed and UTF-8 fragment tokens)."""
    tokenizer = _smollm2_tokenizer()
    backend = GrammarBackend(tokenizer, 49152, eos_token_ids=[tokenizer.eos_token_id])
    try:
        for seed in range(2):
            for regex in (EMAIL_REGEX, UNICODE_REGEX):
                text = decode_walk(backend, tokenizer, SamplingParams(regex=regex), seed, 1.0)
                assert re.fullmatch(regex, text), (regex, text)
            text = decode_walk(backend, tokenizer, SamplingParams(json_schema=SMALL_SCHEMA), seed, 1.0)
            jsonschema.validate(json.loads(text), SMALL_SCHEMA)
        text = decode_walk(backend, tokenizer, SamplingParams(regex=REGEX_INT), 0, 1.0)
        assert re.fullmatch(REGEX_INT, text) and isinstance(int(text.strip()), int), text
    finally:
        backend.shutdown()


def test_scheduler_and_sampler_honour_grammars(tiny_llama_dir):
    """End to end on the tiny random model: constrained requests (mixed with unconstrained ones, greedy
    and sampled) finish on EOS with a full match; the unconstrained ones are unaffected by batching."""
    from sgl_lite.runtime.managers.request import FinishKind, Req
    from sgl_lite.runtime.managers.scheduler import Scheduler
    from sgl_lite.runtime.model_executor.loader import load_tokenizer
    from sgl_lite.runtime.model_executor.model_runner import ModelRunner
    from sgl_lite.runtime.server_args import ServerArgs

    tokenizer = load_tokenizer(tiny_llama_dir)
    args = ServerArgs(model_path=str(tiny_llama_dir), dtype="float32", device="cpu", max_total_tokens=4096,
                      max_running_requests=16)
    runner = ModelRunner(args, model_dir=tiny_llama_dir)

    def run(reqs: list[Req]) -> None:
        scheduler = Scheduler(args, runner, tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id],
                              context_length=runner.context_length)
        for req in reqs:
            scheduler.add_request(req)
        with pytest.raises(ValueError, match="invalid regex"):
            scheduler.add_request(Req("bad", [5, 6], SamplingParams(regex="(unclosed")))
        steps = 0
        while scheduler.has_work() and steps < 2000:
            if not scheduler.has_ready_work():  # only compiles pending (in worker processes): wait, as a server does
                time.sleep(0.01)
                continue
            scheduler.step()
            steps += 1
            scheduler.check_invariant()
        assert all(r.finished for r in reqs)
        scheduler.validator.close()  # its compile workers

    prompt = tokenizer.encode("The answer is")
    bounded = [r"[0-9]{3}", r"(yes|no|maybe)", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"]
    constrained = [
        Req(f"re{i}-{t}", prompt, SamplingParams(regex=rx, temperature=t, seed=i, max_new_tokens=64))
        for i, rx in enumerate(bounded) for t in (0.0, 1.0)
    ] + [Req(f"js-{t}", prompt, SamplingParams(json_schema=SMALL_SCHEMA, temperature=t, seed=7, max_new_tokens=96))
         for t in (0.0, 1.0)]
    free = [Req(f"free{i}", prompt[i:], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
            for i in range(2)]
    run(constrained + free)
    alone = [Req(r.rid, r.input_ids, r.sampling_params) for r in free]
    run(alone)
    for req in constrained:
        assert req.finished_reason.kind is FinishKind.STOP, (req.rid, req.finished_reason)
        assert req.output_ids[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(req.output_ids[:-1], clean_up_tokenization_spaces=False)
        params = req.sampling_params
        if params.regex is not None:
            assert re.fullmatch(params.regex, text), (req.rid, text)
        else:
            jsonschema.validate(json.loads(text), SMALL_SCHEMA)
    for batched, single in zip(free, alone):
        assert batched.output_ids == single.output_ids


def test_terminated_grammar_ends_request_before_min_new_tokens(tiny_backend, tiny_tokenizer):
    """The sampler lets a grammar that allows only EOS win over min_new_tokens; the stop check must
    then end the request too, not keep decoding with a matcher that accepts nothing more."""
    from sgl_lite.runtime.managers.request import FinishKind, Req
    from sgl_lite.runtime.managers.stop_checker import StopChecker

    params = SamplingParams(regex="[0-9]", min_new_tokens=3, max_new_tokens=8)
    req = Req("r", [5, 6], params)
    req.grammar = tiny_backend.request_matcher(params).result()
    eos = tiny_tokenizer.eos_token_id
    for token in (tiny_tokenizer.convert_tokens_to_ids("5"), eos):
        assert req.grammar.accept_token(token)
        req.output_ids.append(token)
    reason = StopChecker(tiny_tokenizer, [eos], context_length=1024).check(req)
    assert reason is not None and reason.kind is FinishKind.STOP and reason.matched == eos
