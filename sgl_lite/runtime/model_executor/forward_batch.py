"""The contract between the scheduler and whatever computes next tokens.

The scheduler picks requests, allocates KV slots for their new tokens, writes those slots into
`req_to_token[req.req_pool_idx, req.kv_len : req.kv_len + extend_len]`, and hands a `ForwardBatch`
to a `ModelRunnerBase`. The runner computes the new tokens' KV into those slots, attends over
`req_to_token[row, : kv_len + extend_len]`, and samples. It does not change any Req field except
the logprob lists and `req.generator`; the scheduler advances `kv_len`, appends tokens and checks
stops.

A real runner (model_runner.py) and the deterministic fake runner of the scheduler tests both
implement this interface, so the scheduler never knows which one it drives.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.memory_pool import ReqToTokenPool


@dataclass
class ForwardBatch:
    reqs: list[Req]
    # Per request: tokens already in KV (positions 0..prefix_lens[i]-1) and tokens computed now,
    # which are req.fill_ids[prefix_lens[i] : prefix_lens[i] + extend_lens[i]]. In a prefill batch
    # some prefix slots may be new slots of an EARLIER request of the same batch (in-batch prefix
    # sharing), so a runner must write every new K/V of a layer before any request attends.
    prefix_lens: list[int]
    extend_lens: list[int]
    # Slots for the new tokens, concatenated in request order (sum(extend_lens) entries).
    out_cache_loc: torch.Tensor
    # Per request: sample a next token after this forward (False for a non-final prefill chunk
    # and for prefill-only requests).
    sample: list[bool]
    # True when every request extends by exactly one token (a decode step).
    is_decode: bool = False
    # Speculative decoding: per request, draft tokens appended after its fill_ids in this forward
    # (extend_lens[i] = tokens of fill_ids computed now + len(draft_ids[i])); None when no row drafts.
    # A drafting row is verified (speculative/verification.py) instead of sampled once.
    draft_ids: list[list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def input_ids(self, i: int) -> list[int]:
        start = self.prefix_lens[i]
        draft = self.draft_ids[i] if self.draft_ids is not None else []
        return self.reqs[i].fill_ids[start : start + self.extend_lens[i] - len(draft)] + list(draft)


@dataclass
class ForwardOutput:
    # One entry per request of the batch: the sampled token id, or None where sample[i] is False.
    next_token_ids: list[int | None]
    # Rows that drafted (batch.draft_ids[i] non-empty): every token to append, the accepted draft
    # prefix then one more (next_token_ids[i] is its first); None for the other rows.
    accepted_ids: list[list[int] | None] = field(default_factory=list)


class ModelRunnerBase(abc.ABC):
    """Computes a ForwardBatch. Implementations own the KV tensors; the scheduler owns the slots."""

    req_to_token: ReqToTokenPool
    vocab_size: int

    @abc.abstractmethod
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run the batch.

        Contract:
        - writes K/V of every new token into `batch.out_cache_loc` (in order), in each layer before
          any request of the batch attends (a request's prefix may hold slots written in this batch);
        - request i attends over slots `req_to_token.table[row_i, : prefix_lens[i] + extend_lens[i]]`,
          causally within its new tokens;
        - for requests with `return_logprob`, appends to `req.input_token_logprobs` the logprob of
          each input token at prompt positions >= max(req.logprob_start_len, 1) that this forward
          computes (the token at position p is scored by the logits at p - 1), and, when sampling,
          appends to `req.output_token_logprobs` / `req.output_top_logprobs` (top_logprobs_num > 0);
        - samples with the request's SamplingParams (greedy when temperature == 0), applying its
          grammar bitmask when `req.grammar` is set; never returns a token for sample[i] False;
        - for a row with draft tokens (batch.draft_ids), computes its new tokens followed by the draft
          and returns in accepted_ids[i] the tokens verification accepts (speculative/verification.py).
        """
