"""RuntimeCore: the one way into the runtime, for the ZeroMQ transport and the in-process Engine.

It owns the tokenizer, the model runner and the scheduler; the transport and the Engine never reach the
scheduler itself (tests and benchmarks read it, `core.scheduler`, to inspect it).
Requests: `make_req` (or `prepare`, which tokenizes long texts on a worker thread) turns user inputs
into a `Req` after the cheap size checks, `submit` validates and queues it (managers/validation.py:
ValueError naming the field at fault), `step` runs one scheduler step, `abort`, `flush_cache`,
`has_work` and `take_reports` do what they say, and `stream_state` gives a request's incremental
detokenizer with the stop-string hold-back. Finished requests come out in SGLang's output shape:
text with the stop marker trimmed (`output_text`), and `meta_info`
{prompt_tokens, completion_tokens, cached_tokens, finish_reason, e2e_latency[, queue_time][, jump_forward_tokens]
[, logprob lists]}.

Test hook: `from_args` honours SGL_LITE_FAULT_INJECT (model_executor/fault_injection.py), which makes forward
passes fail on purpose; unset, it changes nothing.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from sgl_lite.runtime.chat_templates import load_chat_template
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.managers.scheduler import Scheduler
from sgl_lite.runtime.managers.stop_checker import output_ids_for_text, trim_stop
from sgl_lite.runtime.mem_cache.hicache.tier import KVTier
from sgl_lite.runtime.model_executor.fault_injection import install_fault_injection
from sgl_lite.runtime.model_executor.kv_tier_setup import make_kv_tier
from sgl_lite.runtime.protocol import SamplingParams, SessionPin, to_sampling_params
from sgl_lite.runtime.sampling.jump_forward import RETOKENIZE_TAIL_TOKENS, is_constrained
from sgl_lite.runtime.server.detokenizer import IncrementalDetokenizer, stop_hold_back_chars
from sgl_lite.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Texts up to this long are tokenized inline by `prepare` (about a millisecond); longer ones on a thread.
INLINE_TOKENIZE_MAX_CHARS = 4096


class RuntimeCore:
    def __init__(self, args: ServerArgs, tokenizer: Any, runner: Any, model_path: str, eos_token_ids: list[int],
                 tier: KVTier | None = None) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.runner = runner
        self.model_path = model_path
        self.eos_token_ids = eos_token_ids
        self.context_length: int = runner.context_length
        self.scheduler = Scheduler(args, runner, tokenizer=tokenizer, eos_token_ids=eos_token_ids,
                                   context_length=self.context_length, tier=tier)
        self.tier = tier
        self._tokenizer_pool: concurrent.futures.ThreadPoolExecutor | None = None  # created for the first long text

    @classmethod
    def from_args(cls, args: ServerArgs) -> RuntimeCore:
        from sgl_lite.runtime.model_executor import loader
        from sgl_lite.runtime.model_executor.model_runner import ModelRunner

        folder = loader.resolve_model_path(args.model_path)
        tokenizer = loader.load_tokenizer(args.tokenizer_path or folder)
        if args.chat_template is not None:
            tokenizer.chat_template = load_chat_template(args.chat_template)
        # Resolved once: the sampler (min_new_tokens masking) and the stop check use this one set.
        eos_token_ids = eos_ids_of(loader.load_config(folder), tokenizer)
        runner = ModelRunner(args, folder, eos_token_ids=eos_token_ids)
        install_fault_injection(runner)
        core = cls(args, tokenizer, runner, str(folder), eos_token_ids, tier=make_kv_tier(args, runner))
        kv = runner.kv_cache_summary()
        num_params = sum(p.numel() for p in runner.model.parameters())
        logger.info(
            "runtime ready: model %s (%s, %.1fM params, %s), context %d, KV cache %d slots (%.1f MiB %s), "
            "policy %s, max running %d, chunked prefill %s, radix cache %s",
            args.model_path, folder, num_params / 1e6, str(runner.dtype).removeprefix("torch."), core.context_length,
            kv["slots"], kv["bytes"] / 2**20, kv["dtype"], core.scheduler.policy.policy,
            core.scheduler.max_running_requests, core.scheduler.chunk_size,
            "off" if args.disable_radix_cache else ("on, with the disk tier" if core.tier is not None else "on"),
        )
        return core

    def lost_ranks(self) -> str | None:
        """What ended the tensor-parallel group (a rank that exited), or None while it is whole."""
        tp = getattr(self.runner, "tp", None)
        exited = tp.exited_ranks() if tp is not None else []
        if not exited:
            return None
        return ", ".join(f"tensor-parallel rank {rank} exited with code {code}" for rank, code in exited)

    def close(self) -> None:
        """Stop the processes and threads this runtime started: the tensor-parallel ranks, the
        tokenizer thread, the grammar compile workers (idempotent); the disk tier writes what the tree holds
        and it does not (bounded by its write backlog), so a restart finds it."""
        if self.tier is not None:
            self.scheduler.kv.spill_all()
            self.tier.close()
            self.tier = None
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            self._tokenizer_pool = None
        self.scheduler.validator.close()
        tp = getattr(self.runner, "tp", None)  # test runners have no TP group
        if tp is not None:
            tp.close()

    # ------------------------------------------------------------------ the scheduler, for the transport and the Engine

    def submit(self, req: Req) -> None:
        """Validate (managers/validation.py) and queue a request from `make_req`; ValueError names what
        is wrong (QueueFullError when the queue is full)."""
        self.scheduler.add_request(req)

    def abort(self, rid: str, by_client: bool = False) -> bool:
        """Abort a live request (its abort report comes out of the next `step`); False if unknown.
        `by_client`: its client asked, and gets its output so far (Scheduler.abort_request)."""
        return self.scheduler.abort_request(rid, by_client)

    def has_work(self) -> bool:
        """True while anything is queued, running, awaiting a grammar, or an abort awaits its report."""
        return self.scheduler.has_work()

    def has_ready_work(self) -> bool:
        """True when a step would do something now (not only wait for grammar compiles)."""
        return self.scheduler.has_ready_work()

    def is_compiling_grammar(self) -> bool:
        """A grammar compile is running (in a worker process, killed by close(); exit need not wait for it)."""
        return self.scheduler.validator.is_compiling()

    def step(self) -> list[Req]:
        """One scheduler step: every request with new output or a finish since the last step."""
        return self.scheduler.step()

    def take_reports(self) -> list[Req]:
        """Drop-and-return the pending abort reports without running a step."""
        return self.scheduler.take_reports()

    def live_request_ids(self) -> list[str]:
        return self.scheduler.live_request_ids()

    def flush_cache(self) -> bool:
        """Empty the radix cache (the sessions' pins too); False (and nothing done) while requests are in flight."""
        return self.scheduler.flush_cache()

    def unpin_session(self, key: str) -> bool:
        """The session `key` (as the requests' session_pin named it) ended: its prefix is evicted like any other."""
        return self.scheduler.kv.unpin_session(key)

    def check_invariant(self) -> None:
        """AssertionError unless every KV slot and request row is accounted for."""
        self.scheduler.check_invariant()

    def stream_state(self, req: Req) -> IncrementalDetokenizer:
        """The streaming state of `req`: incremental text deltas that never include a prefix of a
        stop string (or plain-text stop_regex) the final text may cut."""
        params = req.sampling_params
        # A jump-forward may retokenize a constrained request's last output ids (sampling/jump_forward.py).
        hold_ids = RETOKENIZE_TAIL_TOKENS if self.scheduler.jump_forward is not None and is_constrained(params) else 0
        return IncrementalDetokenizer(lambda ids: self.decode(ids, params), stop_hold_back_chars(params.trimmed_stops()),
                                      hold_ids)

    # ------------------------------------------------------------------ requests

    def prepare(self, rid: str, text: str | None, input_ids: list[int] | None,
                sampling_params: SamplingParams | dict | None, **options: Any) -> Req | concurrent.futures.Future:
        """`make_req` for the serve loop: a text longer than INLINE_TOKENIZE_MAX_CHARS passes the cheap
        checks here and is tokenized on the tokenizer thread (a Future[Req] comes back), so that the
        loop keeps stepping; anything else is made inline."""
        if not isinstance(text, str) or len(text) <= INLINE_TOKENIZE_MAX_CHARS:
            return self.make_req(rid, text, input_ids, sampling_params, **options)
        params = to_sampling_params(sampling_params)
        self.scheduler.validator.check_raw_request(
            text, input_ids, params, top_logprobs_num=options.get("top_logprobs_num", 0),
            logprob_start_len=options.get("logprob_start_len", -1))
        if self._tokenizer_pool is None:
            self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        return self._tokenizer_pool.submit(self.make_req, rid, text, input_ids, params, **options)

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
        session_pin: SessionPin | None = None,
    ) -> Req:
        """Tokenize one request after the cheap size checks (ValueError names the field); `submit` queues
        it, validating the rest (managers/validation.py)."""
        params = to_sampling_params(sampling_params)
        self.scheduler.validator.check_raw_request(text, input_ids, params, top_logprobs_num=top_logprobs_num,
                                                   logprob_start_len=logprob_start_len)
        ids = list(self.tokenizer(text)["input_ids"]) if text is not None else list(input_ids)  # type: ignore[arg-type]
        return Req(
            rid=rid, input_ids=ids, sampling_params=params, priority=priority, stream=stream, session_pin=session_pin,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
        )

    def decode(self, ids: list[int], params: SamplingParams | None = None) -> str:
        options = params.decode_options() if params is not None else {"skip_special_tokens": True}
        return self.tokenizer.decode(ids, **options)

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
        if self.tier is not None:  # where the cached tokens came from: the pool, or the disk tier
            storage = min(req.tier_loaded_tokens, req.cached_tokens)
            meta["cached_tokens_details"] = {"device": req.cached_tokens - storage, "storage": storage}
        if req.grammar is not None:  # output tokens jump-forward wrote instead of sampling them
            meta["jump_forward_tokens"] = req.jump_forward_tokens
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
            # a prompt text longer than context_length x this is refused before tokenizing (validation.py)
            "max_token_chars": self.scheduler.validator.max_token_chars,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "kv_cache": self.runner.kv_cache_summary(),
        }

    def server_info(self) -> dict[str, Any]:
        from dataclasses import asdict

        args = asdict(self.args)
        args.pop("api_key", None)  # never echo the secrets
        args.pop("admin_api_key", None)
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
