"""Pure parts of the frontend: public signatures (SGLang's), IR, dtype regexes, chat templates, choices math."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

import sgl_lite as sgl
from sgl_lite.lang.chat_template import CHATML, chat_template_from_jinja, chat_template_from_model_info
from sgl_lite.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, SglExprList, SglGen, SglSamplingParams
from sgl_lite.runtime.protocol import SamplingParams

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_GEN_KEYS = ["name", "max_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
             "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob", "logprob_start_len",
             "top_logprobs_num", "return_text_in_logprobs"]
_RUN_SAMPLING = [("max_new_tokens", 128), ("n", 1), ("stop", None), ("stop_token_ids", None), ("stop_regex", None),
                 ("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0), ("frequency_penalty", 0.0),
                 ("presence_penalty", 0.0), ("ignore_eos", False), ("return_logprob", None),
                 ("logprob_start_len", None), ("top_logprobs_num", None), ("return_text_in_logprobs", None)]


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_import_is_torch_free_and_lazy():
    code = "import sgl_lite, sys; assert 'torch' not in sys.modules; assert 'zmq' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_signatures_match_sglang():
    assert _params(sgl.gen) == [
        ("name", None), ("max_tokens", None), ("min_tokens", None), ("n", None), ("stop", None),
        ("stop_token_ids", None), ("stop_regex", None), ("temperature", None), ("top_p", None), ("top_k", None),
        ("min_p", None), ("frequency_penalty", None), ("presence_penalty", None), ("ignore_eos", None),
        ("return_logprob", None), ("logprob_start_len", None), ("top_logprobs_num", None),
        ("return_text_in_logprobs", None), ("dtype", None), ("choices", None), ("choices_method", None),
        ("regex", None), ("json_schema", None)]
    assert _params(sgl.gen_int) == [(k, None) for k in _GEN_KEYS]
    assert _params(sgl.gen_string) == [(k, None) for k in _GEN_KEYS]
    assert _params(sgl.select) == [("name", None), ("choices", None), ("temperature", 0.0),
                                   ("choices_method", sgl.token_length_normalized)]
    assert _params(sgl.function) == [("func", None), ("num_api_spec_tokens", None)]
    for role in ("system", "user", "assistant"):
        assert _params(getattr(sgl, role)) == [("expr", None)]
        assert _params(getattr(sgl, f"{role}_begin")) == []
        assert _params(getattr(sgl, f"{role}_end")) == []
    assert _params(sgl.set_default_backend) == [("backend", inspect.Parameter.empty)]
    assert _params(sgl.flush_cache) == [("backend", None)]
    assert _params(sgl.get_server_info) == [("backend", None)]

    @sgl.function
    def prog(s, a):
        s += a

    run = _params(prog.run)
    assert run[0] == ("args", inspect.Parameter.empty)
    assert run[1:17] == _RUN_SAMPLING
    names = [n for n, _ in run]
    # priority is sgl_lite's addition; everything else in SGLang's order.
    assert [n for n in names if n != "priority"][17:] == ["stream", "backend", "use_thread", "kwargs"]
    assert dict(run)["stream"] is False and dict(run)["backend"] is None and dict(run)["use_thread"] is True
    batch = _params(prog.run_batch)
    assert batch[0] == ("batch_kwargs", inspect.Parameter.empty)
    assert batch[1:17] == _RUN_SAMPLING
    assert [p for p in batch if p[0] != "priority"][17:] == [
        ("backend", None), ("num_threads", "auto"), ("progress_bar", False), ("generator_style", False)]
    endpoint_params = inspect.signature(sgl.RuntimeEndpoint).parameters
    assert list(endpoint_params)[:2] == ["base_url", "api_key"] and endpoint_params["api_key"].default is None


def test_dtype_regexes_are_sglangs():
    assert REGEX_INT == r"[-+]?[0-9]+[ \n]*"
    assert REGEX_FLOAT == r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
    assert REGEX_BOOL == r"(True|False)"
    assert REGEX_STR == r"\"[\w\d\s]*\""
    params = {
        "int": sgl.gen_int("x").sampling_params.to_runtime_params(),
        "float": sgl.gen("x", dtype=float).sampling_params.to_runtime_params(),
        "str": sgl.gen_string("x", stop="!").sampling_params.to_runtime_params(),
        "bool": sgl.gen("x", dtype=bool).sampling_params.to_runtime_params(),
    }
    assert params["int"] == SamplingParams(regex=REGEX_INT, stop=[" ", "\n"])
    assert params["float"] == SamplingParams(regex=REGEX_FLOAT, stop=[" ", "\n"])
    assert params["str"] == SamplingParams(regex=REGEX_STR, stop=["!"])
    assert params["bool"] == SamplingParams(regex=REGEX_BOOL)
    assert re.fullmatch(REGEX_INT, "-42 ") and not re.fullmatch(REGEX_INT, "4.2")
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list).sampling_params.to_runtime_params()
    with pytest.raises(ValueError, match="regex"):
        sgl.gen("x", regex="(")


def test_gen_params_forwarded_and_defaults_resolved():
    expr = sgl.gen("x", max_tokens=7, stop=["\n"], temperature=0, min_tokens=2, json_schema='{"type":"integer"}',
                   top_k=5)
    defaults = SglSamplingParams(max_new_tokens=128, temperature=1.0, top_p=0.9, priority=3)
    merged = expr.sampling_params.resolve(defaults)
    assert merged.to_runtime_params() == SamplingParams(
        max_new_tokens=7, min_new_tokens=2, stop=["\n"], temperature=0, top_p=0.9, top_k=5,
        json_schema='{"type":"integer"}')
    assert merged.priority == 3 and defaults.max_new_tokens == 128


def test_expression_concatenation():
    expr = "Q: " + sgl.gen("a") + "\n" + sgl.gen("b")
    assert isinstance(expr, SglExprList)
    kinds = [type(e).__name__ for e in expr.expr_list]
    assert kinds == ["SglConstantText", "SglGen", "SglConstantText", "SglGen"]
    assert isinstance(sgl.gen("a", choices=["x", "y"]), type(sgl.select("a", ["x", "y"])))
    assert isinstance(sgl.gen("a"), SglGen)
    with pytest.raises(TypeError):
        sgl.gen("a") + 3


def _render(template: str, messages: list[dict], add_generation_prompt: bool = False) -> str:
    from sgl_lite.testing.tiny_model import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = template
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    # The DSL leaves BOS out of the text on purpose: the runtime's tokenizer adds it.
    return text.removeprefix(tok.bos_token)


def _dsl_text(template, messages: list[dict]) -> str:
    text = ""
    if messages[0]["role"] != "system" and template.default_system_prompt:
        messages = [{"role": "system", "content": template.default_system_prompt}] + messages
    for m in messages:
        prefix, suffix = template.get_prefix_and_suffix(m["role"], [])
        text += prefix + m["content"] + suffix
    return text


ZEPHYR_TEMPLATE = (  # ends every message with eos_token
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@pytest.mark.parametrize("source", [SMOLLM2_TEMPLATE, LLAMA3_TEMPLATE, ZEPHYR_TEMPLATE,
                                    __import__("sgl_lite.testing.tiny_model").testing.tiny_model.CHATML_TEMPLATE])
def test_chat_template_roles_reproduce_apply_chat_template(source):
    from sgl_lite.testing.tiny_model import build_tokenizer

    template = chat_template_from_model_info({"chat_template": source, "eos_token": build_tokenizer().eos_token})
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}],
    ]
    for messages in conversations:
        assert _dsl_text(template, messages) == _render(source, messages)
    # What the DSL sends before an assistant gen equals the generation prompt.
    messages = conversations[1]
    assert _dsl_text(template, messages) + template.get_prefix_and_suffix("assistant", [])[0] == \
        _render(source, messages, add_generation_prompt=True)


def test_default_system_prompt_detected():
    assert chat_template_from_jinja(SMOLLM2_TEMPLATE).default_system_prompt == \
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert chat_template_from_jinja(LLAMA3_TEMPLATE).default_system_prompt is None


def test_chat_template_fallbacks():
    assert chat_template_from_model_info({}) is CHATML
    assert chat_template_from_model_info({"eos_token": "<|eot_id|>"}).name == "llama-3-instruct"
    broken = chat_template_from_model_info({"chat_template": "{{ messages[0]['content'][::-1] }}"})
    assert broken is CHATML


def _entries(values):
    return [[v, i, None] for i, v in enumerate(values)]


def test_choices_methods_math():
    choices = ["a", "b", "c"]
    inputs = [_entries([-1.0, -3.0]), _entries([-1.0, -1.5, -1.6]), _entries([-2.0])]
    normalized = [sum(e[0] for e in x) / len(x) for x in inputs]
    common = dict(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=inputs,
                  output_token_logprobs=[[], [], []])
    assert sgl.token_length_normalized(**common).decision == "b"  # means -2, -1.37, -2
    greedy = sgl.greedy_token_selection(**common)
    # Column 0: a and b tie at -1.0 (c has -2); column 1: b (-1.5) beats a (-3).
    assert greedy.decision == "b"
    assert greedy.meta_info["greedy_logprob_matrix"][2] == [-2.0, -2.0, -2.0]
    uncond = [_entries([None, -0.5]), _entries([None, -3.0, -3.0]), _entries([None])]
    result = sgl.unconditional_likelihood_normalized(**common, unconditional_token_logprobs=uncond)
    # a: mean(-1-0, -3+0.5) = -1.75; b: mean(-1, -1.5+3, -1.6+3) = 0.633; c: -2
    assert result.decision == "b"
    assert result.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([-1.75, 0.6333333, -2.0])
    with pytest.raises(ValueError):
        sgl.unconditional_likelihood_normalized(**common)


def test_request_options_forward_logprobs_and_priority():
    params = sgl.gen("x", return_logprob=True, top_logprobs_num=2).sampling_params.resolve(
        SglSamplingParams(max_new_tokens=4, priority=7))
    assert params.request_options() == {"return_logprob": True, "top_logprobs_num": 2, "priority": 7}
    assert SglSamplingParams(logprob_start_len=3).request_options() == {}
