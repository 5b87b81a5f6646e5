"""A request's in-process state, shared by the scheduler, the radix cache and the model runner.

Invariants:
- `fill_ids` (prompt + output so far) is the token sequence the request's KV should hold.
- `kv_len` tokens of `fill_ids` have KV in slots `req_to_token[req_pool_idx, :kv_len]`.
  The first `prefix_len` of those are shared with the radix cache (locked through `last_node`);
  the rest belong to this request alone until it is inserted into the cache.
- A request is in exactly one place: waiting queue, running batch, or finished.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from sgl_lite.runtime.protocol import SamplingParams, SessionPin


class FinishKind(str, enum.Enum):
    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # aborted by the client, by preemption limits, or by an error


ABORTED_BY_CLIENT = "aborted by the client"  # the message of an abort through Scheduler.abort_request


@dataclass
class FinishReason:
    kind: FinishKind
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None  # for ABORT: why
    # For ABORT: the ErrorReply code; "bad_request" when the request itself was at fault (a grammar
    # that does not compile, or not in time), so the caller gets a 400 rather than a server error.
    # None when its client asked for the abort: then the answer is the output so far, as SGLang's
    # (finish_reason {"type": "abort"}), not an error.
    error_code: str | None = "aborted"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind.value}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    priority: int | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # The open session whose latest prefix this request's KV becomes when it finishes: pinned in the radix
    # tree (mem_cache/session_pins.py).
    session_pin: SessionPin | None = None

    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None

    # KV state (see the module docstring).
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_len: int = 0
    last_node: Any = None  # the radix node locked for this request's cached prefix
    cached_tokens: int = 0  # prompt tokens served from the cache (reported in meta_info)
    # The disk tier (managers/tier_loads.py): the radix node locked while its prefix loads and until admission,
    # and how many of its cached tokens the load brought back from disk.
    tier_hold: Any = None
    tier_loaded_tokens: int = 0

    # Scheduling bookkeeping.
    queue_enter_time: float = field(default_factory=time.monotonic)
    admission_time: float | None = None  # when it last left the queue into a prefill batch (scheduler clock)
    first_token_time: float | None = None
    num_retractions: int = 0
    num_preemptions: int = 0

    # Logprobs, filled by the model runner when return_logprob is set (None, and no top logprobs, for a
    # token a jump-forward wrote: the model never scored it).
    input_token_logprobs: list[float] = field(default_factory=list)
    output_token_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    # Constrained decoding matcher (runtime/grammar.py), None when unconstrained.
    grammar: Any = None
    # Per-request sampling generator (seeded requests), created by the sampler on first use.
    generator: Any = None
    # Its stop strings indexed for one-pass matching (stop_checker.StopStrings), built on first use.
    stop_strings: Any = None
    # Its stop_regex patterns compiled (stop_checker.StopRegexes), by the validator or on first use.
    stop_regexes: Any = None

    # N-gram speculative decoding (--speculative-algorithm ngram): the proposer's per-request state
    # (speculative/ngram_proposer.py), verification steps, and draft tokens proposed / accepted.
    spec_state: Any = None
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    # Jump-forward decoding (sampling/jump_forward.py): output tokens written by jumps rather than sampled
    # (net of the sampled tokens their retokenization replaced), and how many leading output tokens no
    # later jump may retokenize (a stream may have sent them).
    jump_forward_tokens: int = 0
    jump_settled: int = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_sampling(self) -> bool:
        """False for prefill-only hints (max_new_tokens == 0)."""
        return self.sampling_params.max_new_tokens > 0
