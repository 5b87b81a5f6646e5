"""The compile side of constrained decoding: xgrammar TokenizerInfo/compiler for one model, the
compile cache, and the per-request matcher. See grammar.py for how the runtime uses them.

JSON schemas are compiled without free whitespace (compact `{"a": 1, "b": [2, 3]}`): with arbitrary
whitespace allowed, small models and random logits can loop on spaces and newlines for ever.

xgrammar 0.2.8 lets raw control characters (U+0000-U+001F, e.g. a tab) into strings that carry a
minLength/maxLength, which makes the output invalid JSON (RFC 8259; json.loads rejects it). We
convert the schema to EBNF ourselves and tighten that character class before compiling
(json_schema_ebnf in compile_worker.py, which runs every conversion and compile in a worker process);
tests/test_grammar.py checks both the upstream behaviour and our fix.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import xgrammar

from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.sampling.compile_pool import CompilePool
from sgl_lite.runtime.sampling.compile_process import CompileProcess, ForkServer
from sgl_lite.runtime.sampling.compile_worker import first_line
from sgl_lite.runtime.sampling.compile_worker import json_schema_ebnf as json_schema_ebnf  # re-exported
from sgl_lite.runtime.sampling.compile_worker import structural_tag_ebnf as structural_tag_ebnf  # re-exported

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]  # (kind: "regex" | "json_schema" | "ebnf" | "structural_tag", canonical text)

# Compiled grammars kept (LRU). Each holds a per-token mask cache of the vocabulary, so the bound matters.
COMPILED_CACHE_SIZE = 128


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    """The cache key of the request's constraint, or None when it is unconstrained.

    A json_schema given as a dict, or as a string holding valid JSON, is re-serialized without
    spaces so that equal schemas share one compiled grammar. Key order is kept: it is the order of
    the properties in the output. An unparsable string is kept as is; compiling it reports the error.
    """
    if params.regex is not None:
        return ("regex", params.regex)
    if params.ebnf is not None:
        return ("ebnf", params.ebnf)
    for kind in ("json_schema", "structural_tag"):
        spec = getattr(params, kind)
        if spec is None:
            continue
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError:
                return (kind, getattr(params, kind))
        return (kind, json.dumps(spec, separators=(",", ":")))
    return None


class GrammarMatcher:
    """One request's position in its grammar (stateful: never share between requests).

    Wraps xgrammar's matcher; rollback is unlimited in xgrammar >= 0.2.
    """

    def __init__(self, compiled: xgrammar.CompiledGrammar, key: GrammarKey, vocab_size: int) -> None:
        self.key = key
        self.vocab_size = vocab_size
        self._compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.stop_token_ids: list[int] = list(self._matcher.stop_token_ids)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar does not allow it.

        After termination nothing is accepted (the request should have finished on the stop token).
        """
        if self._matcher.is_terminated():
            return False
        accepted = self._matcher.accept_token(int(token_id))
        if not accepted:
            logger.warning("grammar %s rejected token %d", self.key[0], token_id)
        return accepted

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match: the request is done."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the output so far is a complete match (a stop token would be accepted)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts in a row (through a stop token that ends it);
        the state is left unchanged. Speculative drafts are cut there."""
        count = 0
        for token in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
                break
            count += 1
        self.rollback(count)
        return count

    def fill_draft_bitmasks(self, draft: Sequence[int], bitmask: torch.Tensor) -> None:
        """Row j of `bitmask` := the tokens allowed after the draft's first j tokens, j = 0..len(draft)
        (a draft the grammar accepts: see allowed_prefix); the state is left unchanged."""
        for j, token in enumerate(draft):
            if not self.fill_bitmask(bitmask, j):
                bitmask[j].fill_(-1)  # every token allowed
            if not self._matcher.accept_token(int(token)):
                self.rollback(j)
                raise ValueError(f"grammar {self.key[0]}: draft token {token} at {j} is not allowed")
        if not self.fill_bitmask(bitmask, len(draft)):
            bitmask[len(draft)].fill_(-1)
        self.rollback(len(draft))

    def jump_forward_string(self) -> str:
        """The text the grammar forces next (xgrammar's find_jump_forward_string; state unchanged): ""
        when the next character is the model's choice, or when the forced bytes are not whole UTF-8
        characters (they then stay the model's to decode)."""
        if self._matcher.is_terminated():
            return ""
        try:
            return self._matcher.find_jump_forward_string()
        except UnicodeDecodeError:
            return ""

    def reset(self) -> None:
        """Back to the start of the grammar (for a request whose output is recomputed from scratch)."""
        self._matcher.reset()

    def admits_nothing(self) -> bool:
        """True when no next token (not even EOS) is allowed from the current state: at the start, a grammar
        whose language is empty; later, a dead end the output cannot be completed from."""
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        return not bool(bitmask.any())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed-next-token bits into `bitmask[row]`; False when every token is allowed.

        A terminated matcher allows only its stop tokens (a request that should already have
        finished then ends with EOS instead of failing the whole batch).
        """
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            for tok in self.stop_token_ids:
                bit = 1 << (tok % 32)
                bitmask[row, tok // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 two's complement
            return True
        return self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    """Compiles constraints for one tokenizer/model, once per distinct spec, in worker processes
    (compile_pool.py: smallest spec first, fair between clients; compile_worker.py: a compile nobody
    waits for any more is killed, and none runs past `cpu_seconds` of CPU time).

    `vocab_size` is the MODEL's vocabulary (the logits width), which may exceed len(tokenizer):
    the extra ids are never allowed by a grammar.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_workers: int = 2,
        *,
        eos_token_ids: Iterable[int] | None = None,
        cpu_seconds: float = 60.0,
    ) -> None:
        stop_ids = sorted(set(eos_token_ids)) if eos_token_ids is not None else None
        self.vocab_size = vocab_size
        self.cpu_seconds = cpu_seconds
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
        )
        self._info_lock = threading.Lock()
        self._info_json: str | None = None
        # One single-threaded worker process each: the box is shared with the model's forward pass.
        self._fork_server = ForkServer(self._tokenizer_info_json)
        self._pool = CompilePool(max_workers, lambda: CompileProcess(self._fork_server))
        self._compiled: OrderedDict[GrammarKey, concurrent.futures.Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._waiters: Counter[GrammarKey] = Counter()  # requests waiting for each key's compile
        self._lock = threading.Lock()

    @staticmethod
    def is_constrained(params: SamplingParams) -> bool:
        return grammar_key(params) is not None

    def validate(self, params: SamplingParams) -> None:
        """Raise ValueError naming the field ("invalid regex: ...") when a regex or EBNF does not parse.

        Parsing those is linear and tokenizer-independent, so it runs on the caller's thread (the
        size is capped before, grammar_limits.py). A JSON schema's conversion to a grammar grows
        super-linearly with its depth: it runs with the compile, in request_matcher, off this thread.
        """
        key = grammar_key(params)
        if key is None:
            return
        kind, text = key
        try:
            if kind == "regex":
                xgrammar.Grammar.from_regex(text)
            elif kind == "ebnf":
                xgrammar.Grammar.from_ebnf(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid {kind}: {first_line(e)}") from None

    def request_matcher(self, params: SamplingParams, owner: str = "") -> concurrent.futures.Future[GrammarMatcher]:
        """A Future of a fresh matcher for the request's constraint (`owner`: the client asking).

        The compile of each distinct spec runs once on the executor and is shared; every call gets
        its own matcher. The Future raises ValueError("invalid <kind>: ...") when compiling fails.
        """
        key = grammar_key(params)
        if key is None:
            raise ValueError("request_matcher called for a request without regex, json_schema, ebnf or structural_tag")
        compiled_future = self.compiled_future(key, owner)
        with self._lock:
            self._waiters[key] += 1
        matcher_future: concurrent.futures.Future[GrammarMatcher] = concurrent.futures.Future()

        def build_matcher(done: concurrent.futures.Future[xgrammar.CompiledGrammar]) -> None:
            try:
                matcher = GrammarMatcher(done.result(), key, self.vocab_size)
                if matcher.admits_nothing():
                    raise ValueError(f"invalid {key[0]}: it admits no output at all "
                                     "(e.g. a $ref that refers to itself without a base case)")
                matcher_future.set_result(matcher)
            except Exception as e:  # the compile error, already a ValueError naming the field
                matcher_future.set_exception(e)

        # Runs on the compile thread when it finishes, or right here when already compiled.
        compiled_future.add_done_callback(build_matcher)
        return matcher_future

    def compiled_future(self, key: GrammarKey, owner: str = "") -> concurrent.futures.Future[xgrammar.CompiledGrammar]:
        """The (cached) compile of `key`; the same Future object for the same key while it is cached."""
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
                return future
            future = self._pool.submit(len(key[1]), lambda process: self._compile(process, key), owner)
            self._compiled[key] = future
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
            return future

    def release(self, params: SamplingParams) -> None:
        """One request stopped waiting for its compile (it finished, was aborted, or ran out of time).
        When nobody waits any more for a compile still queued or running, it is cancelled or written
        off and forgotten, so an abandoned spec costs no more work than it already did."""
        key = grammar_key(params)
        if key is None:
            return
        with self._lock:
            self._waiters[key] -= 1
            if self._waiters[key] > 0:
                return
            del self._waiters[key]
            future = self._compiled.get(key)
            if future is None or future.done():
                return
            del self._compiled[key]
        self._pool.write_off(future)

    def _compile(self, process: CompileProcess, key: GrammarKey) -> xgrammar.CompiledGrammar:
        """On a pool thread: compile in its worker process, and rebuild the result against our TokenizerInfo."""
        serialized = process.compile(key[0], key[1], self.cpu_seconds)
        return xgrammar.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)

    def _tokenizer_info_json(self) -> str:
        """What a worker process starts from (serialized once, on the first worker's start, off the scheduler thread)."""
        with self._info_lock:
            if self._info_json is None:
                self._info_json = self.tokenizer_info.serialize_json()
            return self._info_json

    def is_compiling(self) -> bool:
        return self._pool.busy()

    def shutdown(self) -> None:
        self._fork_server.close()  # first: a worker start waiting for it ends at once
        self._pool.shutdown()
