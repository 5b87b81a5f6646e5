"""SGLang's native worker API: /generate (single or batch, optionally streamed) and cache control.

/generate answers {"text", "output_ids", "meta_info"} (a list of them for a batch). Streaming sends,
like SGLang, the cumulative text and output ids so far in each event, then `data: [DONE]`.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi.responses import JSONResponse, Response

from sgl_lite.http.errors import bad_request
from sgl_lite.http.generation import GenerationInput, RequestRunner
from sgl_lite.http.guards.prompt_budget import Prompt
from sgl_lite.http.openai_api.protocol import MAX_CHOICES
from sgl_lite.http.sglang_api.generate_request import GenerateRequest
from sgl_lite.http.sglang_api.session_api import SessionBinder, SessionTurns
from sgl_lite.http.sse import sse_response
from sgl_lite.http.token_text import TokenTexts
from sgl_lite.runtime.protocol import MAX_RID_CHARS, sampling_params_from_dict

# Checks the prompts of one batch together (guards/prompt_budget.check_batch_prompts), given the field.
BatchCheck = Callable[[Sequence[Prompt], str], Awaitable[None]]


def _as_batch(body: GenerateRequest) -> tuple[list[Prompt], bool]:
    """The prompts as (text, input_ids) pairs, and whether the body was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("exactly one of text and input_ids must be given", "text")
    if isinstance(body.text, str):
        return [(body.text, None)], False
    if body.text is not None:
        return [(t, None) for t in body.text], True
    ids = body.input_ids or []
    if ids and all(isinstance(i, list) for i in ids):
        return [(None, list(i)) for i in ids], True  # type: ignore[arg-type]
    return [(None, list(ids))], False  # type: ignore[arg-type]


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise bad_request(f"{name} has {len(value)} entries but the batch has {count} prompts", name)
        return value
    return [value] * count


def prompt_field(body: GenerateRequest) -> str:
    return "text" if body.text is not None else "input_ids"


def generation_inputs(body: GenerateRequest, max_fanout: int) -> tuple[list[GenerationInput], list[Prompt], bool]:
    """The runtime requests (prompts x n), the prompts, and whether the answer is a list."""
    prompts, is_batch = _as_batch(body)
    field = prompt_field(body)
    if not prompts:
        raise bad_request("the batch is empty", field)
    if len(prompts) > max_fanout:  # before anything is sent: one request must not flood the runtime
        raise bad_request(f"the batch has {len(prompts)} prompts; at most --max-request-fanout {max_fanout}", field)
    params_list = _per_item(body.sampling_params, len(prompts), "sampling_params")
    return_logprobs = _per_item(body.return_logprob, len(prompts), "return_logprob")
    start_lens = _per_item(body.logprob_start_len, len(prompts), "logprob_start_len")
    top_nums = _per_item(body.top_logprobs_num, len(prompts), "top_logprobs_num")
    rids = _per_item(body.rid, len(prompts), "rid") if isinstance(body.rid, list) else [None] * len(prompts)
    if isinstance(body.rid, str):
        if is_batch:
            raise bad_request("rid must be a list with one id per prompt for a batch", "rid")
        rids = [body.rid]
    inputs = []
    for (text, input_ids), params, rid, return_logprob, start_len, top_num in zip(
            prompts, params_list, rids, return_logprobs, start_lens, top_nums):
        params, n = _split_n(params)
        if rid and len(rid) > MAX_RID_CHARS:  # it comes back in every reply: bounded like on the wire
            raise bad_request(f"rid of {len(rid)} characters is longer than {MAX_RID_CHARS}", "rid")
        if n > 1 and rid:
            raise bad_request("rid names one request; leave it out with sampling_params.n > 1", "rid")
        for sample in range(n):
            try:
                sampling = sampling_params_from_dict(_sample_params(params, sample))
            except ValueError as e:
                raise bad_request(str(e), "sampling_params") from None
            extra = {"rid": rid} if rid else {}
            inputs.append(GenerationInput(text, input_ids, sampling, return_logprob=return_logprob,
                                          top_logprobs_num=top_num, logprob_start_len=start_len,
                                          priority=body.priority, **extra))
        is_batch = is_batch or n > 1  # SGLang answers a list of n results, each prompt's samples together
    if len(inputs) > max_fanout:  # prompts x n, still before anything is sent
        raise bad_request(f"the batch asks for {len(inputs)} generations; at most --max-request-fanout {max_fanout}",
                          "sampling_params")
    return inputs, prompts, is_batch


def _split_n(params: dict[str, Any] | None) -> tuple[dict[str, Any] | None, int]:
    """SGLang's sampling_params.n: that many samples of the prompt."""
    if not isinstance(params, dict) or "n" not in params:
        return params, 1
    params = dict(params)
    n = params.pop("n")
    if n is None:  # null is SGLang's default, one sample
        return params, 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"sampling_params.n must be an integer in 1..{MAX_CHOICES}; got {n!r}", "sampling_params")
    return params, n


def _sample_params(params: dict[str, Any] | None, sample: int) -> dict[str, Any] | None:
    # With a seed, sample i uses seed + i: the samples differ but stay reproducible (as OpenAI's n).
    if sample and isinstance(params, dict) and isinstance(params.get("seed"), int):
        return {**params, "seed": params["seed"] + sample}
    return params


async def generate(runner: RequestRunner, body: GenerateRequest, on_stream_end: Callable[[str], None],
                   token_texts: TokenTexts | None = None, *, max_fanout: int,
                   check_batch: BatchCheck | None = None, sessions: SessionBinder | None = None) -> Response:
    """`token_texts` fills the text slot of each logprob entry (SGLang's return_text_in_logprobs);
    `check_batch` bounds the prompts of a batch of two or more together, before anything is sent;
    `sessions` runs the requests with session_params in their sessions (session_api.py)."""
    inputs, prompts, is_batch = generation_inputs(body, max_fanout)
    if check_batch is not None and len(prompts) > 1:
        await check_batch(prompts, prompt_field(body))
    turns = SessionTurns()
    if body.session_params is not None:
        if sessions is None:
            raise bad_request("session_params: sessions are not served here", "session_params")
        turns = await sessions.bind(body.session_params, inputs, body.sampling_params)
    if body.stream:
        return await sse_response(_stream_events(runner, inputs, is_batch, token_texts, turns), on_stream_end)
    try:
        generations = await runner.collect_many(inputs)
        for index, generation in enumerate(generations):
            turns.finish(index, generation.output_ids)
    finally:
        turns.close()
    results = [{"text": g.text, "output_ids": g.output_ids,
                "meta_info": _with_token_texts({**g.meta_info, "id": r.rid}, token_texts)}
               for g, r in zip(generations, inputs)]
    return JSONResponse(results if is_batch else results[0])


def _with_token_texts(meta_info: dict[str, Any], token_texts: TokenTexts | None) -> dict[str, Any]:
    """Logprob entries (logprob, token_id, None) -> (logprob, token_id, token text)."""
    if token_texts is None:
        return meta_info

    def named(entry: Any) -> Any:
        if isinstance(entry, (list, tuple)) and len(entry) == 3:
            return [entry[0], entry[1], token_texts.token_text(entry[1])]
        return entry

    out = dict(meta_info)
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if out.get(key):
            out[key] = [named(e) for e in out[key]]
    if out.get("output_top_logprobs"):
        out["output_top_logprobs"] = [[named(e) for e in position] if position else position
                                      for position in out["output_top_logprobs"]]
    return out


async def _stream_events(runner: RequestRunner, inputs: list[GenerationInput], is_batch: bool,
                         token_texts: TokenTexts | None, turns: SessionTurns) -> AsyncIterator[dict[str, Any]]:
    texts = [""] * len(inputs)
    output_ids: list[list[int]] = [[] for _ in inputs]
    async with turns, aclosing(runner.stream_many(inputs)) as deltas:
        async for index, delta in deltas:
            texts[index] += delta.text
            output_ids[index].extend(delta.output_ids)
            if delta.finish_reason is not None:
                turns.finish(index, output_ids[index])
            event: dict[str, Any] = {"text": texts[index], "output_ids": list(output_ids[index]),
                                     "meta_info": _with_token_texts({**delta.meta_info, "id": inputs[index].rid}, token_texts)}
            if is_batch:
                event["index"] = index
            yield event


def flush_cache_response(flushed: bool) -> Response:
    if flushed:
        return Response("Cache flushed.\n", media_type="text/plain")
    return JSONResponse(
        {"error": {"message": "cache not flushed: the runtime has requests in flight; retry when idle",
                   "type": "invalid_request_error", "param": None, "code": "busy"}},
        status_code=400,
    )
