"""The attention backend interface and the per-batch metadata every backend consumes.

The metadata is FlashInfer's page-size-1 layout, built once per forward from the ForwardBatch and
the request-to-slot table:

- `qo_indptr` [B+1]: request i's new tokens are rows qo_indptr[i]:qo_indptr[i+1] of q/k/v.
- `kv_indptr` [B+1]: request i attends over kv_indices[kv_indptr[i]:kv_indptr[i+1]].
- `kv_indices` [total_kv]: slot ids, in token order, of every request's whole sequence
  (cached prefix followed by the new tokens).
- `out_cache_loc` [N]: where the new tokens' K/V are written (the tail of each request's slots).

With page size 1 every "page" is one slot, so FlashInfer's paged_kv_last_page_len is all ones.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, field

import torch

from sgl_lite.runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int64 [total_kv]
    out_cache_loc: torch.Tensor  # int64 [N]
    prefix_lens: list[int]
    extend_lens: list[int]
    # Request i's rows of the req-to-token table, padded with slot 0 to the longest sequence:
    # kv_indices is exactly padded_kv_indices[i, :seq_lens[i]] concatenated over i.
    padded_kv_indices: torch.Tensor  # int64 [B, max_kv_len]
    seq_lens: torch.Tensor  # int64 [B]
    # Requests whose new tokens each attend like a decode step's token (speculative verification
    # rows: a few draft tokens over a long cached prefix). Backends with a decode path run them there,
    # one query per new token, instead of as an extend.
    verify_rows: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.numel())

    @property
    def is_decode(self) -> bool:
        """Every request extends its sequence by exactly one token."""
        return all(e == 1 for e in self.extend_lens)

    @property
    def has_prefill_rows(self) -> bool:
        """Some request extends by a prompt's tokens: more than one new token, not a verification row."""
        verify = set(self.verify_rows)
        return any(e > 1 and i not in verify for i, e in enumerate(self.extend_lens))

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_lens, default=0)

    @property
    def max_kv_len(self) -> int:
        return int(self.padded_kv_indices.shape[1])

    @classmethod
    def build(
        cls,
        req_pool_rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_to_token: ReqToTokenPool,
        verify_rows: list[int] | None = None,
    ) -> AttentionMetadata:
        """Gather every request's slot row from the table with one indexing op (no per-token Python); the
        lengths and offsets are summed in Python first (a decode step's batch is a few requests, and each
        torch op on such tiny tensors costs more than the list arithmetic)."""
        device = req_to_token.table.device
        if not (len(req_pool_rows) == len(prefix_lens) == len(extend_lens)):
            raise ValueError("req_pool_rows, prefix_lens and extend_lens must have one entry per request")
        num_new = sum(extend_lens)
        if out_cache_loc.numel() != num_new:
            raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} slots but the batch extends {num_new} tokens")
        seq_list = [p + e for p, e in zip(prefix_lens, extend_lens)]
        max_kv = max(seq_list, default=0)
        if max_kv > req_to_token.max_context:
            raise ValueError(f"a request needs {max_kv} KV slots, more than the context length {req_to_token.max_context}")
        seq = torch.tensor(seq_list, dtype=torch.int64, device=device)
        padded = req_to_token.table[torch.tensor(req_pool_rows, dtype=torch.int64, device=device), :max_kv]
        valid = torch.arange(max_kv, device=device)[None, :] < seq[:, None]
        kv_indices = padded[valid]
        padded.masked_fill_(~valid, 0)  # a copy of the table's rows (advanced indexing), not a view
        return cls(
            qo_indptr=torch.tensor([0, *itertools.accumulate(extend_lens)], dtype=torch.int32, device=device),
            kv_indptr=torch.tensor([0, *itertools.accumulate(seq_list)], dtype=torch.int32, device=device),
            kv_indices=kv_indices,
            out_cache_loc=out_cache_loc.to(device, torch.int64),
            prefix_lens=list(prefix_lens),
            extend_lens=list(extend_lens),
            padded_kv_indices=padded,
            seq_lens=seq,
            verify_rows=list(verify_rows or []),
        )

    def decode_queries(self, reqs: list[int]) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Every new token of the requests `reqs` (batch indices, ascending) as an independent decode
        query: its q row (None when they are all the batch's rows in order), its request, and how many
        keys it sees (new token j of request i sees prefix_i + j + 1 positions)."""
        device = self.padded_kv_indices.device
        if len(reqs) == self.batch_size and self.is_decode:
            return None, torch.arange(len(reqs), device=device), self.seq_lens
        idx = torch.tensor(reqs, dtype=torch.int64, device=device)
        extend = torch.tensor(self.extend_lens, dtype=torch.int64, device=device)[idx]
        req_idx = torch.repeat_interleave(idx, extend)
        offsets = torch.arange(int(extend.sum()), device=device) - torch.repeat_interleave(torch.cumsum(extend, 0) - extend, extend)
        seq = torch.repeat_interleave(self.seq_lens[idx] - extend, extend) + offsets + 1
        if len(reqs) == self.batch_size:
            return None, req_idx, seq
        return self.qo_indptr[:-1].to(torch.int64)[req_idx] + offsets, req_idx, seq


@dataclass
class DecodeKernelInputs:
    """What a fused decode layer (kernels/csrc/layer/decode_layer.cpp) needs to run this batch's attention itself:
    every request is a decode row or a speculative verification row, attended by the paged decode kernel
    over the pool in the model's dtype."""

    out_cache_loc: torch.Tensor  # int64 [N]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int64 [total_kv]
    scale: float
    qo_indptr: torch.Tensor | None = None  # int32 [B+1]: each request's q rows; None when each has one


class AttentionBackend(abc.ABC):
    """Computes paged attention for one forward batch.

    Contract:
    - `prepare(meta)` is called once per forward, before any layer; backends precompute index
      tensors / masks / kernel plans there, so that per-layer work is only data movement and math.
    - `forward(layer_id, q, k, v, kv_pool)` with q [N, Hq, D] and k, v [N, Hkv, D] (N = the batch's
      new tokens, rows ordered by qo_indptr, RoPE already applied) first writes k/v into
      `kv_pool` layer `layer_id` at `meta.out_cache_loc`, then returns [N, Hq, D]: for each request,
      softmax(q K^T * scale) V over the slots kv_indices[kv_indptr[i]:kv_indptr[i+1]], where new token
      j (0-based within the request) sees the prefix and new tokens 0..j (causal with offset).
      GQA: query head h reads KV head h // (Hq // Hkv).
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5

    @abc.abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None: ...

    @abc.abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor: ...

    def decode_kernel_inputs(self, kv_pool: KVPool) -> DecodeKernelInputs | None:
        """After `prepare`: the inputs with which a fused decode layer computes exactly what `forward`
        would for this batch, or None when this backend or batch has no such path (the default)."""
        return None
