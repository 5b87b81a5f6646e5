"""Every check a request must pass before it is queued; each failure is a ValueError naming the field or limit.

The one place requests are validated, in two stages, cheapest checks first:
- `check_raw_request`, before the prompt is tokenized or its ids copied: the shape of the input and its
  size (O(1): a text longer than the context can hold, or more input_ids than the context, is refused
  by its length before anything scans or tokenizes it);
- `validate`, once per request, by `Scheduler.add_request`: sampling params, then lengths and limits
  (a null max_new_tokens becomes what fits, SGLang's rule), then the scan of every token id, the stop_regex
  patterns (compiled here, once), then the grammar (compiled off the scheduler thread).

Also owns the grammar backend (created on the first constrained request, so unconstrained serving
never imports xgrammar) and the default priority.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Iterable
from typing import Any

import msgspec

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.managers.stop_checker import StopRegexes
from sgl_lite.runtime.protocol import INT64_MAX, MAX_TOP_LOGPROBS_NUM, SamplingParams
from sgl_lite.runtime.sampling.grammar_limits import check_grammar_limits
from sgl_lite.runtime.server_args import ServerArgs


class QueueFullError(ValueError):
    """The waiting queue holds --max-queued-requests requests."""


def client_of(rid: str) -> str:
    """The client a request came from, for what is shared fairly between clients (grammar compiles):
    the server keys a request as "<client identity hex>/<its rid>" (server/event_loop.py); "" in process."""
    client, slash, _ = rid.partition("/")
    return client if slash else ""


class RequestValidator:
    def __init__(
        self,
        args: ServerArgs,
        tokenizer: Any,
        vocab_size: int,
        context_length: int,
        num_slots: int,
        eos_token_ids: Iterable[int],
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.num_slots = num_slots
        self.eos_token_ids = list(eos_token_ids)
        self._grammar_backend: Any = None
        # The priority of a request that gives none (sgl_lite: 0 in both directions).
        self.priority_default: int | None = 0 if args.enable_priority_scheduling else None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """No token decodes to more characters than its vocabulary entry has (byte-level: one per byte),
        so a text longer than context * this cannot fit and is refused before tokenizing."""
        vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
        return max((len(t) for t in vocab), default=1)

    def check_raw_request(self, text: Any, input_ids: Any, params: SamplingParams, *, top_logprobs_num: int,
                          logprob_start_len: int) -> None:
        """Before tokenizing or copying: exactly one prompt form, of the right type and a size that can
        fit, and logprob options in range (checked even when return_logprob is off, which drops them)."""
        self._check_logprob_options(top_logprobs_num, logprob_start_len)
        if (text is None) == (input_ids is None):
            raise ValueError("give exactly one of text (prompt) or input_ids")
        if text is not None:
            if not isinstance(text, str):
                raise ValueError(f"text must be a string; got {type(text).__name__}")
            if len(text) > self.context_length * self.max_token_chars:
                raise ValueError(f"the prompt text ({len(text)} characters) is longer than the context length "
                                 f"{self.context_length} tokens can hold")
            cap = self.args.max_prefill_tokens_per_request
            if cap is not None and len(text) > cap * self.max_token_chars:
                raise ValueError(f"the prompt text ({len(text)} characters) is longer than "
                                 f"--max-prefill-tokens-per-request {cap} tokens can hold")
            return
        if not isinstance(input_ids, list):
            raise ValueError("input_ids must be a list of integers")
        self._check_length(len(input_ids), params)

    def validate(self, req: Req) -> concurrent.futures.Future | None:
        """Raise ValueError unless `req` can run; return its grammar-matcher Future when constrained."""
        params = req.sampling_params
        params.validate(self.vocab_size)
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("the prompt is empty: input_ids (or text) must hold at least one token")
        self._check_length(n, params)
        if n > self.num_slots:
            raise ValueError(f"prompt ({n} tokens) exceeds the KV cache pool of {self.num_slots} slots (--max-total-tokens)")
        if params.max_new_tokens is None:
            params = req.sampling_params = self._as_many_as_fit(params, n)
        self._check_logprobs(req, n)
        self._check_priority(req.priority)
        # The one scan of the ids, last of the cheap checks: by now there are at most context-length of them.
        bad = next((t for t in req.input_ids
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            if not isinstance(bad, int) or isinstance(bad, bool):
                raise ValueError("input_ids must be a list of integers")
            raise ValueError(f"input_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})")
        if params.stop_regex:
            if self.tokenizer is None:
                raise ValueError("stop_regex needs a tokenizer, and this scheduler has none")
            req.stop_regexes = StopRegexes(params.stop_regex)
        if params.regex is None and params.json_schema is None and params.ebnf is None and params.structural_tag is None:
            return None
        check_grammar_limits(params, self.args.max_grammar_chars, self.args.max_json_schema_depth)
        backend = self._grammar()
        backend.validate(params)
        return backend.request_matcher(params, owner=client_of(req.rid))

    def _as_many_as_fit(self, params: SamplingParams, n: int) -> SamplingParams:
        """SGLang's null max_new_tokens: up to the context and the KV pool, less the prompt; min_new_tokens
        lowered to it where it is more (SGLang's rule). A copy: one SamplingParams may serve several prompts."""
        most = max(min(self.context_length, self.num_slots) - n, 0)
        return msgspec.structs.replace(params, max_new_tokens=most, min_new_tokens=min(params.min_new_tokens, most))

    def _check_length(self, n: int, params: SamplingParams) -> None:
        cap = self.args.max_prefill_tokens_per_request
        if cap is not None and n > cap:
            raise ValueError(f"prompt ({n} tokens) exceeds --max-prefill-tokens-per-request {cap}: "
                             "one request may prefill at most that many tokens on this server")
        if params.max_new_tokens is not None and n + params.max_new_tokens > self.context_length:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the context length "
                f"{self.context_length}")

    def _check_logprob_options(self, top_logprobs_num: int, logprob_start_len: int) -> None:
        most = min(self.vocab_size, MAX_TOP_LOGPROBS_NUM)
        if not 0 <= top_logprobs_num <= most:
            raise ValueError(f"top_logprobs_num must be in [0, {most}]; got {top_logprobs_num}")
        if logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be >= -1 (-1: no input logprobs); got {logprob_start_len}")

    def _check_logprobs(self, req: Req, n: int) -> None:
        self._check_logprob_options(req.top_logprobs_num, req.logprob_start_len)
        if req.return_logprob and req.logprob_start_len >= n:
            raise ValueError(f"logprob_start_len ({req.logprob_start_len}) must be < the prompt length ({n})")

    def _check_priority(self, priority: Any) -> None:
        if priority is None:
            return
        if not isinstance(priority, int) or isinstance(priority, bool) or not -INT64_MAX <= priority <= INT64_MAX:
            raise ValueError(f"priority must be an integer in [-2**63 + 1, 2**63 - 1]; got {priority!r}")
        if not self.args.enable_priority_scheduling and self.args.abort_on_priority_when_disabled:
            raise ValueError("priority was given but priority scheduling is disabled on this server "
                             "(--enable-priority-scheduling); send the request without a priority")

    def release_grammar(self, req: Req) -> None:
        """`req` no longer waits for its grammar compile (compiled, aborted or out of time)."""
        if self._grammar_backend is not None:
            self._grammar_backend.release(req.sampling_params)

    def is_compiling(self) -> bool:
        return self._grammar_backend is not None and self._grammar_backend.is_compiling()

    def close(self) -> None:
        """Stop the grammar compile workers (their processes) and cancel what they had queued."""
        if self._grammar_backend is not None:
            self._grammar_backend.shutdown()

    def _grammar(self) -> Any:
        if self._grammar_backend is None:
            if self.tokenizer is None:
                raise ValueError("regex / json_schema / ebnf / structural_tag need a tokenizer, and this scheduler has none")
            from sgl_lite.runtime.sampling.grammar import GrammarBackend

            self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, self.args.grammar_compile_workers,
                                                   cpu_seconds=self.args.grammar_compile_timeout,
                                                   eos_token_ids=self.eos_token_ids)
        return self._grammar_backend
