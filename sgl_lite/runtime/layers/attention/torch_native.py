"""Paged attention in plain torch for CPU (and any device without FlashInfer).

One interface serves prefill, chunked prefill and decode: every request extends a cached prefix by
one or more tokens. Requests are split once per forward (in `prepare`) into two groups:

- single-token requests (decode steps): all of them in two batched matmuls per layer. One
  index_select per layer gathers every KV head of every request straight into a contiguous
  head-major [G, Hkv, L, D] tensor (the pool viewed as rows of D elements; the row index of slot s,
  head h is s * Hkv + h, precomputed once per forward). Contiguous operands matter: bf16 matmul on
  CPU is several times slower on strided views, and per-head gathers of strided pool views cost many
  times a row gather. Scores and softmax are float32, padding is masked with an additive -inf bias.
- multi-token requests (prefill chunks): per request, query tiles of at most 128 rows, each two
  matmuls against the request's contiguous K/V (keys cut at the tile's last position) with an additive
  causal bias built once per forward. Faster than SDPA with a mask (the prefix offset keeps it off
  the causal fast path; is_causal without a prefix) on SmolLM2's heads in bf16, most for agent turns'
  short extends on long prefixes (docs/performance.md, "Decode attention kernel, 8-bit KV cache, threads
  on a shared box"; `python scripts/bench_extend_attention.py`). Tiles shrink as the
  context grows so that one tile's float32 scores stay around 4 MiB (cache-resident).

On a CPU where oneDNN has no bf16 (AVX2 only), torch's bf16 matmul falls back to a kernel far slower than
float32's, so there bf16 operands are widened to float32 for the matmuls (exactly) and the result rounded
back once, which makes a bf16 prefill several times faster (docs/performance.md, "On CPUs without AVX-512
(AVX2 + FMA)"). The same holds, less steeply, where VDPBF16PS runs at half the rate of float32 FMAs
(oneDNN's bf16 matmuls then reach about half the rate of MKL's float32 ones; docs/performance.md, "On
CPUs whose float32 FMAs outrun VDPBF16PS").

GQA never materializes repeated KV: queries are viewed as [G, Hkv, group, D], so each KV head is
read once for its whole query group.

Padding positions read slot 0, which the pool keeps finite (mem_cache/memory_pool.py): a masked probability of 0
times a NaN would still poison the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_lite.runtime.layers.attention.base import AttentionBackend, AttentionMetadata
from sgl_lite.runtime.layers.linear import bf16_gemv_fma
from sgl_lite.runtime.layers.onednn import amx_matmuls, onednn_bf16_supported
from sgl_lite.runtime.mem_cache.memory_pool import KVPool


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # q rows of the group; None when the group is the whole batch in order
    pool_rows: torch.Tensor  # int64 [G * Hkv * L]: rows of the pool viewed as [slots * Hkv, D], head-major per request
    max_len: int  # L
    mask_bias: torch.Tensor  # float32 [G, 1, 1, L]: 0 where attended, -inf on padding


_MAX_TILE_ROWS = 128
_TILE_SCORES = 1 << 20  # float32 scores of one tile (rows x keys x query heads): ~4 MiB


@dataclass
class _QueryTile:
    first: int  # rows [first, last) of the request's new tokens
    last: int
    bias: torch.Tensor  # float32 [last - first, prefix + last]: 0 where attended, -inf after each row's position


@dataclass
class ExtendReq:
    start: int  # first q row
    end: int
    kv_slots: torch.Tensor  # int64 [prefix + extend]
    prefix: int
    # built by the first layer that runs this request through the torch path (a backend with its own
    # extend kernel never builds them: their causal biases are MBs for a long prompt)
    tiles: list[_QueryTile] | None = None


def query_tiles(prefix: int, extend: int, num_q_heads: int, device: torch.device) -> list[_QueryTile]:
    """Even tiles of at most 128 rows, fewer when the context is long, each with its causal bias."""
    rows = max(16, min(_MAX_TILE_ROWS, _TILE_SCORES // (num_q_heads * (prefix + extend))))
    count = -(-extend // rows)
    bounds = [extend * i // count for i in range(count + 1)]
    tiles = []
    for first, last in zip(bounds, bounds[1:]):
        # new token j sits at position prefix + j and sees positions 0..prefix + j
        later = torch.arange(prefix + last, device=device)[None, :] > (prefix + torch.arange(first, last, device=device)[:, None])
        bias = torch.zeros(later.shape, dtype=torch.float32, device=device).masked_fill_(later, float("-inf"))
        tiles.append(_QueryTile(first=first, last=last, bias=bias))
    return tiles


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention's matmuls run in: `dtype`, except bf16 on a CPU whose float32 matmuls are the
    faster ones (float32): without oneDNN's bf16, or where float32 FMAs outrun VDPBF16PS (linear.bf16_gemv_fma)
    and oneDNN has no AMX tiles to run bf16 on (onednn.amx_matmuls)."""
    if dtype == torch.bfloat16 and device.type == "cpu" and (not onednn_bf16_supported() or (bf16_gemv_fma() and not amx_matmuls())):
        return torch.float32
    return dtype


class TorchNativeBackend(AttentionBackend):
    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, scale)
        self.group = num_q_heads // num_kv_heads
        self._meta: AttentionMetadata | None = None
        self._decode: _DecodeGroup | None = None
        self._extends: list[ExtendReq] = []

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        verify = set(meta.verify_rows)
        single = [i for i, e in enumerate(meta.extend_lens) if e == 1 or i in verify]
        self._decode = self._prepare_decode(meta, single) if single else None
        self._extends = []
        qo = meta.qo_indptr.tolist()
        seq_lens = meta.seq_lens.tolist()
        for i, (prefix, extend) in enumerate(zip(meta.prefix_lens, meta.extend_lens)):
            if extend <= 1 or i in verify:
                continue
            slots = meta.padded_kv_indices[i, : seq_lens[i]]
            self._extends.append(ExtendReq(start=qo[i], end=qo[i + 1], kv_slots=slots, prefix=prefix))

    def _prepare_decode(self, meta: AttentionMetadata, single: list[int]) -> _DecodeGroup:
        """Index rows and padding mask of the decode queries of requests `single` (batch indices)."""
        device = meta.padded_kv_indices.device
        rows, req_idx, seq = meta.decode_queries(single)
        slots = meta.padded_kv_indices if rows is None and meta.is_decode else meta.padded_kv_indices[req_idx, : int(seq.max())]
        length = int(slots.shape[1])
        heads = torch.arange(self.num_kv_heads, dtype=torch.int64, device=device)
        pool_rows = (slots[:, None, :] * self.num_kv_heads + heads[None, :, None]).reshape(-1)
        valid = torch.arange(length, device=device)[None, :] < seq[:, None]
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(~valid, float("-inf"))
        return _DecodeGroup(rows=rows, pool_rows=pool_rows, max_len=length, mask_bias=bias[:, None, None, :])

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        meta = self._meta
        if meta is None:
            raise RuntimeError("TorchNativeBackend.forward called before prepare()")
        kv_pool.write(layer_id, meta.out_cache_loc, k, v)
        k_cache, v_cache = kv_pool.k[layer_id], kv_pool.v[layer_id]
        if self._decode is not None and self._decode.rows is None:
            return self._decode_attention(q, k_cache, v_cache, self._decode)
        out = torch.empty_like(q)
        if self._decode is not None:
            out[self._decode.rows] = self._decode_attention(q[self._decode.rows], k_cache, v_cache, self._decode)
        self._extend_all(q, k, v, k_cache, v_cache, out)
        return out

    def _extend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor) -> None:
        """Write the attention of every multi-token request's rows into `out`."""
        for req in self._extends:
            self._extend_attention(q, k, v, k_cache, v_cache, req, out)

    def _decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup
    ) -> torch.Tensor:
        num, length, hkv, dim = q.shape[0], group.max_len, self.num_kv_heads, self.head_dim
        compute = matmul_dtype(q.dtype, q.device)
        # .to() is a no-op unless the pool stores 8-bit floats, which are converted after the gather, or
        # the matmuls run wider than q
        keys = k_cache.view(-1, dim).index_select(0, group.pool_rows).to(compute).view(num, hkv, length, dim)
        values = v_cache.view(-1, dim).index_select(0, group.pool_rows).to(compute).view(num, hkv, length, dim)
        qg = q.reshape(num, hkv, self.group, dim).to(compute)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(self.scale).add_(group.mask_bias)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).to(compute)  # [G, Hkv, group, L]
        return torch.matmul(probs, values).reshape(num, self.num_q_heads, dim).to(q.dtype)

    def _extend_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req: ExtendReq,
        out: torch.Tensor,
    ) -> None:
        """Write the attention of one request's new rows into `out` (rows req.start..req.end)."""
        hkv, dim = self.num_kv_heads, self.head_dim
        compute = matmul_dtype(q.dtype, q.device)
        if req.prefix == 0:  # the whole context is new: this forward's own k/v rows
            keys, values = k[req.start : req.end], v[req.start : req.end]
        else:
            keys = k_cache.index_select(0, req.kv_slots)
            values = v_cache.index_select(0, req.kv_slots)
        # head-major and contiguous: bf16 matmul on CPU is several times slower on strided operands
        keys = keys.to(compute).transpose(0, 1).contiguous()  # [Hkv, L, D]
        values = values.to(compute).transpose(0, 1).contiguous()
        if req.tiles is None:
            req.tiles = query_tiles(req.prefix, req.end - req.start, self.num_q_heads, q.device)
        for tile in req.tiles:
            rows, context = tile.last - tile.first, req.prefix + tile.last
            qt = q[req.start + tile.first : req.start + tile.last].transpose(0, 1).to(compute)  # [Hq, rows, D]
            qt = qt.reshape(hkv, self.group * rows, dim)  # query heads h*group..h*group+group-1 share KV head h
            scores = torch.matmul(qt, keys[:, :context].transpose(-1, -2)).float().mul_(self.scale)
            scores = scores.view(hkv, self.group, rows, context).add_(tile.bias)
            probs = torch.softmax(scores, dim=-1).to(q.dtype).to(compute).view(hkv, self.group * rows, context)
            result = torch.matmul(probs, values[:, :context]).view(self.num_q_heads, rows, dim)
            out[req.start + tile.first : req.start + tile.last] = result.transpose(0, 1)
