"""RuntimeCore: what the in-process Engine and the ZeroMQ server share.

It owns the tokenizer, the model runner and the scheduler, turns user inputs into validated `Req`s
(tokenizing text; ValueError naming the field at fault) and turns finished requests into SGLang's
output shape: text with the stop marker trimmed, and meta_info
{prompt_tokens, completion_tokens, cached_tokens, finish_reason, e2e_latency[, queue_time][, logprob lists]}.

Test hook: `from_args` honours SGL_LITE_FAULT_INJECT (model_executor/fault_injection.py), which makes forward
passes fail on purpose; unset, it changes nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sgl_lite.runtime.model_executor.fault_injection import install_fault_injection
from sgl_lite.runtime.protocol import SamplingParams, sampling_params_from_dict
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.runtime.managers.stop_checker import output_ids_for_text, trim_stop

logger = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1


class RuntimeCore:
    def __init__(self, args: ServerArgs, tokenizer: Any, runner: Any, model_path: str, eos_token_ids: list[int]) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.runner = runner
        self.model_path = model_path
        self.eos_token_ids = eos_token_ids
        self.context_length: int = runner.context_length
        # No token decodes to more characters than its vocabulary entry has (byte-level: one per
        # byte), so a text longer than context * this cannot fit and is refused before tokenizing.
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.max_token_chars = max((len(t) for t in vocab), default=1)
        self.scheduler = Scheduler(args, runner, tokenizer=tokenizer, eos_token_ids=eos_token_ids,
                                   context_length=self.context_length)

    @classmethod
    def from_args(cls, args: ServerArgs) -> RuntimeCore:
        from sgl_lite.runtime.model_executor import loader
        from sgl_lite.runtime.model_executor.model_runner import ModelRunner

        folder = loader.resolve_model_path(args.model_path)
        tokenizer = loader.load_tokenizer(args.tokenizer_path or folder)
        runner = ModelRunner(args, folder)
        install_fault_injection(runner)
        core = cls(args, tokenizer, runner, str(folder), eos_ids_of(runner.config, tokenizer))
        kv = runner.kv_cache_summary()
        num_params = sum(p.numel() for p in runner.model.parameters())
        logger.info(
            "runtime ready: model %s (%s, %.1fM params, %s), context %d, KV cache %d slots (%.1f MiB %s), "
            "policy %s, max running %d, chunked prefill %s, radix cache %s",
            args.model_path, folder, num_params / 1e6, str(runner.dtype).removeprefix("torch."), core.context_length,
            kv["slots"], kv["bytes"] / 2**20, kv["dtype"], core.scheduler.policy.policy,
            core.scheduler.max_running_requests, core.scheduler.chunk_size,
            "off" if args.disable_radix_cache else "on",
        )
        return core

    def close(self) -> None:
        """Stop the processes this runtime started: the tensor-parallel ranks (idempotent)."""
        tp = getattr(self.runner, "tp", None)  # test runners have no TP group
        if tp is not None:
            tp.close()

    # ------------------------------------------------------------------ requests

    def make_req(
        self,
        rid: str,
        text: str | None,
        input_ids: list[int] | None,
        sampling_params: SamplingParams | dict | None,
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        priority: int | None = None,
        stream: bool = False,
    ) -> Req:
        """Tokenize and validate one request (ValueError names the field); does not queue it."""
        if (text is None) == (input_ids is None):
            raise ValueError("give exactly one of text (prompt) or input_ids")
        if text is not None:
            if not isinstance(text, str):
                raise ValueError(f"text must be a string; got {type(text).__name__}")
            if len(text) > self.context_length * self.max_token_chars:
                raise ValueError(f"the prompt text ({len(text)} characters) is longer than the context length "
                                 f"{self.context_length} tokens can hold")
            ids = list(self.tokenizer(text)["input_ids"])
        else:
            if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
                raise ValueError("input_ids must be a list of integers")
            ids = list(input_ids)
        params = sampling_params_from_dict(sampling_params)
        params.validate(self.runner.vocab_size)
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)
                                     or not -INT64_MAX <= priority <= INT64_MAX):
            raise ValueError(f"priority must be an integer in [-2**63 + 1, 2**63 - 1]; got {priority!r}")
        if not 0 <= top_logprobs_num <= self.runner.vocab_size:
            raise ValueError(f"top_logprobs_num must be in [0, vocab size {self.runner.vocab_size}]; got {top_logprobs_num}")
        if logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be >= -1 (-1: no input logprobs); got {logprob_start_len}")
        return Req(
            rid=rid, input_ids=ids, sampling_params=params, priority=priority, stream=stream,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
        )

    def decode(self, ids: list[int], params: SamplingParams | None = None) -> str:
        skip = params.skip_special_tokens if params is not None else True
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def output_text(self, req: Req) -> str:
        """The final text: stop token left out and stop string cut (unless no_stop_trim)."""
        params = req.sampling_params
        ids = output_ids_for_text(req.output_ids, req.finished_reason, params)
        text = self.decode(ids, params)
        reason = req.finished_reason
        if reason is None or not isinstance(reason.matched, str) or params.no_stop_trim:
            return text
        return trim_stop(text, self.decode(ids[:-1], params), reason, params)

    def meta_info(self, req: Req) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finished_reason.to_json() if req.finished_reason is not None else None,
            "e2e_latency": time.monotonic() - req.arrival_time,
        }
        # Seconds from its last entry into the queue (arrival, or a retraction / preemption) to its
        # admission into a prefill batch; absent for a request that never left the queue since.
        admitted, entered = req.admission_time, req.queue_enter_time
        if admitted is not None and admitted >= entered:
            meta["queue_time"] = admitted - entered
        if req.spec_verify_ct:
            # SGLang's meta_info names: verification forwards, and accepted draft tokens per forward.
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = req.spec_accepted_tokens / req.spec_verify_ct
            meta["spec_accept_rate"] = req.spec_accepted_tokens / max(req.spec_draft_tokens, 1)
        if req.return_logprob:
            meta.update(logprob_lists(req))
        return meta

    # ------------------------------------------------------------------ info

    def model_info(self) -> dict[str, Any]:
        tok = self.tokenizer
        return {
            "model_path": self.model_path,
            "served_model_name": self.args.model_path,
            "context_length": self.context_length,
            "vocab_size": self.runner.vocab_size,
            "chat_template": getattr(tok, "chat_template", None),
            "bos_token": getattr(tok, "bos_token", None),
            "bos_token_id": getattr(tok, "bos_token_id", None),
            "eos_token": getattr(tok, "eos_token", None),
            "eos_token_ids": list(self.eos_token_ids),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "kv_cache": self.runner.kv_cache_summary(),
        }

    def server_info(self) -> dict[str, Any]:
        from dataclasses import asdict

        args = asdict(self.args)
        args.pop("api_key", None)  # never echo the secret
        return {**self.model_info(), **self.scheduler.stats(), "server_args": args}


def eos_ids_of(config: Any, tokenizer: Any) -> list[int]:
    """EOS ids from the model config (int or list) plus the tokenizer's eos token."""
    ids: set[int] = set()
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(t) for t in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def logprob_lists(req: Req) -> dict[str, list]:
    """SGLang's shape: lists of (logprob, token_id, None); output_top_logprobs: per position a list of those."""
    inputs: list[tuple[float | None, int, None]] = []
    if req.logprob_start_len >= 0:
        start = req.logprob_start_len
        if start == 0:
            inputs.append((None, req.input_ids[0], None))  # the first token has no context to score it
        scored = req.input_ids[max(start, 1):]
        inputs.extend((lp, tok, None) for lp, tok in zip(req.input_token_logprobs, scored))
    outputs = [(lp, tok, None) for lp, tok in zip(req.output_token_logprobs, req.output_ids)]
    tops = [[(lp, tok, None) for tok, lp in position] for position in req.output_top_logprobs]
    return {"input_token_logprobs": inputs, "output_token_logprobs": outputs, "output_top_logprobs": tops}
