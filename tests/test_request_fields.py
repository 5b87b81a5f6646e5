"""The request surface without a server: SGLang's /generate field set, sampling dicts read as SGLang
reads them, strict types, the OpenAI routes' field lists, and chat rendering options against
transformers' own apply_chat_template."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from sgl_lite.http.chat_template import ChatTemplate, ChatTemplateError, RenderOptions
from sgl_lite.http.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from sgl_lite.http.openai_api.request_fields import IGNORED_FIELDS, UNSERVED_FIELDS
from sgl_lite.http.sglang_api.generate_request import NO_EFFECT_REQUEST_FIELDS, UNSERVED_REQUEST_FIELDS, GenerateRequest
from sgl_lite.runtime.protocol import SamplingParams, to_sampling_params
from sgl_lite.runtime.sampling_dict import NO_EFFECT_SAMPLING_FIELDS, UNSERVED_SAMPLING_FIELDS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "http.md"

# SGLang 0.5.23's GenerateReqInput fields (python/sglang/srt/managers/io_struct.py), in its order.
SGLANG_GENERATE_FIELDS = [
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "watermark", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_text_in_logprobs", "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "stream", "log_metrics", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
    "routing_key", "conversation_id", "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens",
    "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy", "return_prompt_token_ids",
    "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt", "kv_hints",
]
# SGLang 0.5.23's SamplingParams API fields (python/sglang/srt/sampling/sampling_params.py), each at its default
# (n is the HTTP front's: that many samples).
SGLANG_SAMPLING_DEFAULTS = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "beam_width": None, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None, "logit_bias": None,
    "sampling_seed": None, "custom_params": None, "watermark": None,
}


def test_generate_request_declares_exactly_sglangs_fields() -> None:
    # sgl_lite keeps `model`, which sglang-router sends; every other field is SGLang's.
    assert set(GenerateRequest.model_fields) == set(SGLANG_GENERATE_FIELDS) | {"model"}
    declared = set(UNSERVED_REQUEST_FIELDS) | set(NO_EFFECT_REQUEST_FIELDS)
    assert declared <= set(GenerateRequest.model_fields)


def test_every_sglang_sampling_field_is_read() -> None:
    assert to_sampling_params({k: v for k, v in SGLANG_SAMPLING_DEFAULTS.items()}) == SamplingParams()
    with pytest.raises(ValueError, match="tempurature"):
        to_sampling_params({"tempurature": 0.5})


def test_sampling_dict_nulls_seed_alias_and_unserved_fields() -> None:
    params = to_sampling_params({"temperature": None, "top_k": None, "sampling_seed": 7, "stream_interval": 4,
                                 "custom_params": {"k": 1}, "stop_regex": [], "beam_width": 1})
    assert params.temperature == 1.0 and params.top_k == -1 and params.seed == 7 and params.stream_interval == 4
    for field, value in [("beam_width", 2), ("watermark", {"key": "k"})]:
        with pytest.raises(ValueError, match=field):
            to_sampling_params({field: value})
    with pytest.raises(ValueError, match="sampling_seed"):
        to_sampling_params({"seed": 1, "sampling_seed": 2})
    # null max_new_tokens is SGLang's "up to the context": it travels as null, unlike the other nulls.
    assert to_sampling_params({"max_new_tokens": None}).max_new_tokens is None
    assert to_sampling_params({}).max_new_tokens == 128
    # logit_bias keys are strings on the wire (JSON's); a Python caller's int keys are read as SGLang reads them.
    assert to_sampling_params({"logit_bias": {5: 1, "7": -2.5}}).logit_bias == {"5": 1.0, "7": -2.5}
    for field, value in [("ignore_eos", "yes"), ("stop_token_ids", ["1"]), ("max_new_tokens", True)]:
        with pytest.raises(ValueError, match=field):
            to_sampling_params({field: value})


def _first_error(model: type, body: dict) -> tuple[str, str]:
    with pytest.raises(ValidationError) as excinfo:
        model.model_validate_json(json.dumps(body))
    error = excinfo.value.errors()[0]
    return str(error["loc"][0]), error["msg"]


@pytest.mark.parametrize("body, field", [
    ({"input_ids": ["1"]}, "input_ids"),
    ({"text": "x", "stream": "yes"}, "stream"),
    ({"text": "x", "return_logprob": 1}, "return_logprob"),
    ({"text": "x", "priority": "3"}, "priority"),
    ({"text": "x", "colour": "red"}, "colour"),
    ({"text": "x", "image_data": "cat.png"}, "image_data"),
    ({"text": "x", "lora_path": "adapter"}, "lora_path"),
    ({"text": "x", "session_params": {"id": "s", "replace": "yes"}}, "session_params"),
    ({"text": "x", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": "x", "data_parallel_rank": 1}, "data_parallel_rank"),
])
def test_generate_request_refuses_with_the_field_named(body: dict, field: str) -> None:
    assert _first_error(GenerateRequest, body)[0] == field


def test_generate_request_takes_off_values_and_no_effect_fields() -> None:
    body = GenerateRequest.model_validate_json(json.dumps({
        "text": ["a", "b"], "image_data": None, "lora_path": [None, None], "return_hidden_states": False,
        "session_id": "s1", "custom_labels": {"team": "x"}, "log_metrics": False, "return_logprob": [True, False],
        "logprob_start_len": None, "routed_dp_rank": 0}))
    assert body.return_logprob == [True, False] and body.logprob_start_len == -1


@pytest.mark.parametrize("model, body, field", [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": ["1"]}, "stop_token_ids"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "guided_json": {}}, "guided_json"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "a"}}, "audio"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     "modalities"),
    (CompletionRequest, {"prompt": [1, "2"]}, "prompt"),
    (CompletionRequest, {"prompt": "x", "echo": "true"}, "echo"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1": "high"}}, "logit_bias"),
    (CompletionRequest, {"prompt": "x", "stop_regex": 5}, "stop_regex"),
])
def test_openai_requests_refuse_with_the_field_named(model: type, body: dict, field: str) -> None:
    assert _first_error(model, body)[0] == field


def test_openai_ignored_fields_are_accepted() -> None:
    values = {"user": "u", "metadata": {"a": "b"}, "store": True, "service_tier": "auto", "safety_identifier": "s",
              "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {}}
    assert set(values) == set(IGNORED_FIELDS)
    ChatCompletionRequest.model_validate_json(json.dumps({"messages": [{"role": "user", "content": "x"}], **values,
                                                          "modalities": ["text"]}))


def test_docs_table_names_every_field() -> None:
    text = DOCS.read_text()
    named = set(re.findall(r"`([a-z_0-9]+)`", text))
    for fields in (SGLANG_GENERATE_FIELDS, SGLANG_SAMPLING_DEFAULTS, IGNORED_FIELDS, UNSERVED_FIELDS,
                   UNSERVED_SAMPLING_FIELDS, NO_EFFECT_SAMPLING_FIELDS):
        assert not set(fields) - named, set(fields) - named


# A ChatML template that reads the variables chat_template_kwargs and reasoning_effort set.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% if reasoning_effort is defined %}{{ 'effort: ' + reasoning_effort + '\n' }}{% endif %}{% endif %}"
)
# A template that trims each message, so a final message's trailing space is not written.
TRIMMING_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] | trim + '\n\n' }}"
                     "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


@pytest.mark.parametrize("template", [THINKING_TEMPLATE, TRIMMING_TEMPLATE])
def test_render_options_match_transformers(tiny_llama_dir: Path, template: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ours = ChatTemplate(template, tokenizer.bos_token, tokenizer.eos_token)
    chat = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "The city is "}]

    def theirs(**kwargs: object) -> str:
        return tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False, **kwargs)

    assert ours.render(chat, options=RenderOptions(False, True)) == theirs(continue_final_message=True)
    assert ours.render(chat, options=RenderOptions(False)) == theirs(add_generation_prompt=False)
    kwargs = {"enable_thinking": False, "reasoning_effort": "low"}
    assert ours.render(chat[:1], options=RenderOptions(template_kwargs=kwargs)) == theirs_for(tokenizer, template,
                                                                                             chat[:1], kwargs)
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        ours.render(chat, options=RenderOptions(True, True))
    with pytest.raises(ChatTemplateError, match="bos_token"):
        ours.render(chat, options=RenderOptions(template_kwargs={"bos_token": "x"}))


def theirs_for(tokenizer: object, template: str, chat: list, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False,  # type: ignore[attr-defined]
                                         add_generation_prompt=True, **kwargs)


def test_chat_request_render_options() -> None:
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    body = ChatCompletionRequest(messages=chat, continue_final_message=True, reasoning_effort="high",
                                 chat_template_kwargs={"enable_thinking": True})
    assert body.render_options() == RenderOptions(False, True, {"enable_thinking": True, "reasoning_effort": "high"})
    clash = ChatCompletionRequest(messages=chat, continue_final_message=True, add_generation_prompt=True)
    assert clash.unsupported_field()[0] == "continue_final_message"  # type: ignore[index]
    reserved = ChatCompletionRequest(messages=chat, chat_template_kwargs={"messages": []})
    assert reserved.unsupported_field()[0] == "chat_template_kwargs"  # type: ignore[index]
