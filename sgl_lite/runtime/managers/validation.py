"""Checks a request must pass before it is queued; each failure is a ValueError naming the field or limit.

Also owns the grammar backend (created on the first constrained request, so unconstrained serving
never imports xgrammar) and the default priority.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import Any

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.sampling.grammar_limits import check_grammar_limits
from sgl_lite.runtime.server_args import ServerArgs


class AdmissionChecks:
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

    def validate(self, req: Req) -> concurrent.futures.Future | None:
        """Raise ValueError unless `req` can run; return its grammar-matcher Future when constrained."""
        params = req.sampling_params
        params.validate(self.vocab_size)
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("the prompt is empty: input_ids (or text) must hold at least one token")
        bad = next((t for t in req.input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"input_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})")
        if n + params.max_new_tokens > self.context_length:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the context length "
                f"{self.context_length}")
        if n > self.num_slots:
            raise ValueError(f"prompt ({n} tokens) exceeds the KV cache pool of {self.num_slots} slots (--max-total-tokens)")
        if req.return_logprob and req.logprob_start_len >= n:
            raise ValueError(f"logprob_start_len ({req.logprob_start_len}) must be < the prompt length ({n})")
        if req.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0; got {req.top_logprobs_num}")
        if req.priority is not None and not self.args.enable_priority_scheduling and self.args.abort_on_priority_when_disabled:
            raise ValueError("priority was given but priority scheduling is disabled on this server "
                             "(--enable-priority-scheduling); send the request without a priority")
        if params.regex is None and params.json_schema is None and params.ebnf is None:
            return None
        check_grammar_limits(params, self.args.max_grammar_chars, self.args.max_json_schema_depth)
        backend = self._grammar()
        backend.validate(params)
        return backend.request_matcher(params)

    def release_grammar(self, req: Req) -> None:
        """`req` no longer waits for its grammar compile (compiled, aborted or out of time)."""
        if self._grammar_backend is not None:
            self._grammar_backend.release(req.sampling_params)

    def is_compiling(self) -> bool:
        return self._grammar_backend is not None and self._grammar_backend.is_compiling()

    def _grammar(self) -> Any:
        if self._grammar_backend is None:
            if self.tokenizer is None:
                raise ValueError("regex / json_schema / ebnf need a tokenizer, and this scheduler has none")
            from sgl_lite.runtime.sampling.grammar import GrammarBackend

            self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, self.args.grammar_compile_workers,
                                                   eos_token_ids=self.eos_token_ids)
        return self._grammar_backend
