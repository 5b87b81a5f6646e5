"""A deterministic stand-in for the model runner: scheduler tests check real outputs without a model.

The fake "KV" of a slot is the (token, position) pair written there. The next token of a request
is a hash of the tokens READ BACK from its KV slots, so a wrong prefix-cache hit, a lost chunk
or a stale slot changes the output, while a correct cache never does. `reference_output` computes
the same tokens from the plain token list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sgl_lite.runtime.mem_cache.memory_pool import ReqToTokenPool
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch, ForwardOutput, ModelRunnerBase

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def next_token(tokens: list[int], vocab_size: int) -> int:
    h = 0
    for t in tokens:
        h = (h * _BASE + t + 1) % _MOD
    return h % vocab_size


def input_logprob(tokens_before: list[int], token: int) -> float:
    """The fake logprob of `token` following `tokens_before` (deterministic, negative)."""
    return -1.0 - ((len(tokens_before) * 31 + token) % 97) / 10.0


def reference_output(prompt: list[int], max_new_tokens: int, vocab_size: int, stop_ids: set[int] = frozenset()) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        tok = next_token(tokens, vocab_size)
        tokens.append(tok)
        out.append(tok)
        if tok in stop_ids:
            break
    return out


@dataclass
class BatchRecord:
    is_decode: bool
    rids: list[str]
    prefix_lens: list[int]
    extend_lens: list[int]


@dataclass
class FakeRunner(ModelRunnerBase):
    num_slots: int = 4096
    max_running_requests: int = 64
    context_length: int = 4096
    vocab_size: int = 64
    records: list[BatchRecord] = field(default_factory=list)
    record: bool = True
    check_kv: bool = True

    def __post_init__(self) -> None:
        self.req_to_token = ReqToTokenPool(self.max_running_requests, self.context_length)
        # Fake KV: token and position per slot; -1 = never written.
        self.kv_token = torch.full((self.num_slots + 1,), -1, dtype=torch.int64)
        self.kv_pos = torch.full((self.num_slots + 1,), -1, dtype=torch.int64)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        assert batch.out_cache_loc.numel() == batch.num_tokens, "out_cache_loc must hold one slot per new token"
        assert len(set(batch.out_cache_loc.tolist())) == batch.num_tokens, "a slot is used twice in one batch"
        assert int(batch.out_cache_loc.min()) >= 1, "slot 0 is padding and must never be written"
        if self.record:
            self.records.append(BatchRecord(batch.is_decode, [r.rid for r in batch.reqs], list(batch.prefix_lens), list(batch.extend_lens)))
        offset = 0
        next_ids: list[int | None] = []
        for i, req in enumerate(batch.reqs):
            start, n = batch.prefix_lens[i], batch.extend_lens[i]
            new_tokens = batch.input_ids(i)
            slots = batch.out_cache_loc[offset : offset + n]
            offset += n
            assert torch.equal(self.req_to_token.table[req.req_pool_idx, start : start + n], slots)
            self.kv_token[slots] = torch.tensor(new_tokens, dtype=torch.int64)
            self.kv_pos[slots] = torch.arange(start, start + n)
            row = self.req_to_token.table[req.req_pool_idx, : start + n]
            seen = self.kv_token[row].tolist()
            if self.check_kv:
                assert torch.equal(self.kv_pos[row], torch.arange(start + n)), f"{req.rid}: KV positions are wrong"
                assert seen == req.fill_ids[: start + n], f"{req.rid}: KV holds other tokens than fill_ids"
            if req.return_logprob and req.logprob_start_len >= 0:
                # Like the real runner: logits at row p (computed now) score the prompt token at p + 1.
                first = max(start + 1, req.logprob_start_len, 1)
                for q in range(first, min(start + n + 1, len(req.input_ids))):
                    req.input_token_logprobs.append(input_logprob(seen[:q], req.input_ids[q]))
            if batch.sample[i]:
                tok = next_token(seen, self.vocab_size)
                next_ids.append(tok)
                if req.return_logprob:
                    req.output_token_logprobs.append(input_logprob(seen, tok))
            else:
                next_ids.append(None)
        return ForwardOutput(next_ids)
