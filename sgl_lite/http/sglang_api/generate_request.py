"""The body of SGLang's native /generate: every field of SGLang's GenerateReqInput, each honoured,
accepted where it cannot change the result, or refused unless off.

The field set is SGLang's (srt/managers/io_struct.py, GenerateReqInput), so SGLang's own clients
(its frontend's RuntimeEndpoint, sglang-router, which forwards its whole request struct) are served
as they are; a field SGLang does not know is refused. Types are strict: "1" is not a token id and
"yes" not a bool. docs/http.md has the table of what becomes of each field.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, field_validator

from sgl_lite.http.openai_api.protocol import MAX_TOP_LOGPROBS
from sgl_lite.http.sglang_api.session_api import SessionParamsField

# Features sgl_lite does not have: the field is accepted at its off value (null, false, empty, or a
# per-prompt list of those) and refused otherwise, with this reason.
_TEXT_ONLY = "sgl_lite serves text-only models; leave it out"
UNSERVED_REQUEST_FIELDS: dict[str, str] = {
    **{name: _TEXT_ONLY for name in (
        "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "video_config",
        "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch",
        "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config", "mm_processor_kwargs",
        "positional_embed_overrides")},
    **{name: "this output is not produced by sgl_lite; leave it false" for name in (
        "return_hidden_states", "return_routed_experts", "return_indexer_topk", "return_entropy", "return_bytes",
        "return_prompt_token_ids", "return_sampling_mask", "return_flat_raw_top_logprobs",
        "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64")},
    "token_ids_logprob": "logprobs of chosen token ids are not supported by sgl_lite; use top_logprobs_num",
    "sampling_logprobs_mode": "sampling logprob modes are not supported by sgl_lite",
    **{name: "prefill/decode disaggregation is not supported by sgl_lite" for name in (
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
        "disagg_prefill_dp_rank")},
    "lora_path": "LoRA adapters are not supported by sgl_lite",
    "lora_id": "LoRA adapters are not supported by sgl_lite",
    "custom_logit_processor": "custom logit processors are not run by sgl_lite",
    "watermark": "watermarking is not supported by sgl_lite",
    "extra_key": "prefix-cache namespaces are not supported by sgl_lite (every request shares one cache)",
    "cache_salt": "prefix-cache namespaces are not supported by sgl_lite (every request shares one cache)",
    "require_reasoning": "reasoning controls are not supported by sgl_lite",
    "max_thinking_tokens": "reasoning controls are not supported by sgl_lite",
    "multi_item_delimiter_indices": "multi-item scoring is not supported by sgl_lite",
    "token_indices_to_pool": "pooling readouts are not supported by sgl_lite",
    "background": "background requests are not supported by sgl_lite; leave it false",
}
# Fields that cannot change the result here: accepted (type-checked) and not used. Why, per field:
NO_EFFECT_REQUEST_FIELDS: dict[str, str] = {
    "model": "one model is served; /generate, like SGLang's, does not check the name",
    "log_metrics": "metrics are recorded for every request",
    "custom_labels": "metric labels are fixed",
    "session_id": "an identity shared by a session's requests; it does not alter the prompt",
    "routing_key": "a routing hint for a router",
    "conversation_id": "a tracking id",
    "received_time": "a timing field SGLang's own front fills in",
    "external_trace_header": "trace propagation is not implemented",
    "http_worker_ipc": "SGLang's internal multi-tokenizer routing",
    "kv_hints": "hints for hierarchical KV storage, which sgl_lite does not have",
    "modalities": "describes multimodal inputs, which are refused",
    "use_audio_in_video": "describes video inputs, which are refused",
    "routed_experts_start_len": "read only with return_routed_experts, which is refused",
    "data_parallel_rank": "each sgl_lite worker is one data-parallel rank (0); other ranks are refused",
    "routed_dp_rank": "each sgl_lite worker is one data-parallel rank (0); other ranks are refused",
}


class GenerateRequest(BaseModel):
    """SGLang's native /generate body (GenerateReqInput)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # Honoured.
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None
    rid: Union[str, list[str], None] = None
    stream: bool = False
    # Each of the three logprob options may be one value or one per prompt, as in SGLang.
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1
    top_logprobs_num: Union[int, list[int]] = 0
    return_text_in_logprobs: bool = False
    priority: int | None = None
    # SGLang's sessions: continue an earlier request of an open session (session_api.py); one per prompt, or one for all.
    session_params: SessionParamsField = None
    # True: refused while the front or the runtime writes request text to its log (--log-requests), which it
    # otherwise would; without --log-requests no request's text is logged.
    no_logs: bool = False

    # No effect here (NO_EFFECT_REQUEST_FIELDS says why).
    model: str | None = None
    log_metrics: bool = True
    custom_labels: dict[str, str] | None = None
    session_id: str | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    received_time: float | None = None
    external_trace_header: dict[str, Any] | None = None
    http_worker_ipc: str | None = None
    kv_hints: Union[dict[str, Any], list[Union[dict[str, Any], None]], None] = None
    modalities: list[str] | None = None
    use_audio_in_video: bool = False
    routed_experts_start_len: int = 0
    data_parallel_rank: int | None = None
    routed_dp_rank: int | None = None

    # Refused unless off (UNSERVED_REQUEST_FIELDS says why); typed loosely, since only the off value passes.
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    video_config: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    positional_embed_overrides: Any = None
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    return_indexer_topk: Any = False
    return_entropy: Any = False
    return_bytes: Any = False
    return_prompt_token_ids: Any = False
    return_sampling_mask: Any = None
    return_flat_raw_top_logprobs: Any = False
    return_flat_raw_output_top_logprobs: Any = False
    return_flat_raw_top_logprobs_b64: Any = False
    token_ids_logprob: Any = None
    sampling_logprobs_mode: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    disagg_prefill_dp_rank: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    watermark: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    require_reasoning: Any = False
    max_thinking_tokens: Any = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None
    background: Any = False

    @field_validator("return_logprob", "logprob_start_len", "top_logprobs_num", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: Any) -> Any:
        # SGLang's clients (its Runtime.generate among them) send null for "not given".
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("top_logprobs_num")
    @classmethod
    def _top_logprobs_range(cls, value: int | list[int]) -> int | list[int]:
        for number in value if isinstance(value, list) else [value]:
            if not 0 <= number <= MAX_TOP_LOGPROBS:
                raise ValueError(f"must be in [0, {MAX_TOP_LOGPROBS}]; got {number}")
        return value

    @field_validator("data_parallel_rank", "routed_dp_rank")
    @classmethod
    def _single_rank(cls, value: int | None) -> int | None:
        # Each sgl_lite worker is a single DP rank; data parallelism is the router's, across workers.
        if value not in (None, 0):
            raise ValueError("this worker has one data-parallel rank (0)")
        return value

    @field_validator(*UNSERVED_REQUEST_FIELDS)
    @classmethod
    def _unserved(cls, value: Any, info: Any) -> Any:
        if not _is_off(value):
            raise ValueError(UNSERVED_REQUEST_FIELDS[info.field_name])
        return value


def _is_off(value: Any) -> bool:
    """Null, false, empty, or a per-prompt list of those."""
    if isinstance(value, list):
        return all(item is None or item is False for item in value)
    return value is None or value is False or value in ("", {})
