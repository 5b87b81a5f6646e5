"""Attention whose every output row is bitwise the same however the row was batched
(`--enable-deterministic-inference`).

The default CPU backend computes a prefill with SDPA and a decode step with batched matmuls; their
reduction orders depend on how many query rows and keys a call gets. In bfloat16 a last-bit
difference in one layer can change a greedy token, so the same prompt answered differently once
its prefix was cached (the suffix is then computed alone, or as a decode step, instead of inside
the full prompt's prefill).

Here every row takes one path whose arithmetic depends only on the row itself:
- per request, queries in tiles of QUERY_TILE rows (the last tile padded), keys in chunks of
  KEY_CHUNK positions starting at position 0 (the last chunk padded with slot 0, masked);
- float32 throughout (K/V read from the bf16 pool and widened); every matmul has the same shape,
  so its reduction order is the same for every tile and chunk;
- softmax with the row's exact maximum, the exponentials summed chunk by chunk in position order,
  and P.V accumulated chunk by chunk in the same order. Chunks past a row's causal limit are fully
  masked and add exact zeros, so a row's result does not depend on how many keys follow it.

The matmuls of the linear layers are row-independent on oneDNN CPU kernels (checked by
tests/test_determinism.py for every shape of the model it runs), so only attention needs this.
Cost: one Python-level loop over tiles and chunks per request and layer (see README).
"""

from __future__ import annotations

import torch

from sgl_lite.runtime.layers.attention.base import AttentionBackend, AttentionMetadata
from sgl_lite.runtime.mem_cache.memory_pool import KVPool

QUERY_TILE = 16
KEY_CHUNK = 64


class BatchInvariantBackend(AttentionBackend):
    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, scale)
        self.group = num_q_heads // num_kv_heads
        self._meta: AttentionMetadata | None = None
        self._reqs: list[tuple[int, int, int, torch.Tensor]] = []  # (first q row, extend, prefix, padded key slots)

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        qo = meta.qo_indptr.tolist()
        self._reqs = []
        for i, (prefix, extend) in enumerate(zip(meta.prefix_lens, meta.extend_lens)):
            length = prefix + extend
            padded = -(-length // KEY_CHUNK) * KEY_CHUNK
            slots = torch.zeros(padded, dtype=torch.int64, device=meta.padded_kv_indices.device)
            slots[:length] = meta.padded_kv_indices[i, :length]
            self._reqs.append((qo[i], extend, prefix, slots))

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        if self._meta is None:
            raise RuntimeError("BatchInvariantBackend.forward called before prepare()")
        k_cache, v_cache = kv_pool.k[layer_id], kv_pool.v[layer_id]
        k_cache.index_copy_(0, self._meta.out_cache_loc, k)
        v_cache.index_copy_(0, self._meta.out_cache_loc, v)
        out = torch.empty_like(q)
        for start, extend, prefix, slots in self._reqs:
            keys = k_cache.index_select(0, slots).float().permute(1, 2, 0)  # [Hkv, D, padded]
            values = v_cache.index_select(0, slots).float().transpose(0, 1)  # [Hkv, padded, D]
            for tile in range(0, extend, QUERY_TILE):
                rows = min(QUERY_TILE, extend - tile)
                out[start + tile : start + tile + rows] = self._tile(
                    q[start + tile : start + tile + rows], prefix + tile, keys, values)[:rows].to(q.dtype)
        return out

    def _tile(self, q: torch.Tensor, first_pos: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Rows at positions first_pos.. (fewer than QUERY_TILE: padded) -> [QUERY_TILE, Hq, D] float32."""
        hkv, dim, tile = self.num_kv_heads, self.head_dim, QUERY_TILE
        qf = torch.zeros(tile, self.num_q_heads, dim, dtype=torch.float32, device=q.device)
        qf[: q.shape[0]] = q
        # [Hkv, group * tile, D]: each KV head's query group, one fixed-shape matmul per key chunk.
        qg = qf.view(tile, hkv, self.group, dim).permute(1, 2, 0, 3).reshape(hkv, self.group * tile, dim)
        last = first_pos + tile  # keys at positions >= last are masked for every row of the tile
        num_chunks = -(-min(last, keys.shape[-1]) // KEY_CHUNK)
        positions = first_pos + torch.arange(tile, device=q.device).repeat(self.group)  # per row of qg
        scores = []
        for c in range(num_chunks):
            s = torch.bmm(qg, keys[:, :, c * KEY_CHUNK : (c + 1) * KEY_CHUNK]).mul_(self.scale)
            key_pos = c * KEY_CHUNK + torch.arange(KEY_CHUNK, device=q.device)
            scores.append(s.masked_fill_(key_pos[None, None, :] > positions[None, :, None], float("-inf")))
        row_max = torch.stack([s.amax(-1) for s in scores]).amax(0)  # exact: max does not round
        denom = torch.zeros_like(row_max)
        acc = torch.zeros(hkv, self.group * tile, dim, dtype=torch.float32, device=q.device)
        for c, s in enumerate(scores):
            p = torch.exp(s - row_max[..., None])
            denom += p.sum(-1)
            acc += torch.bmm(p, values[:, c * KEY_CHUNK : (c + 1) * KEY_CHUNK])
        out = acc / denom[..., None]
        return out.view(hkv, self.group, tile, dim).permute(2, 0, 1, 3).reshape(tile, self.num_q_heads, dim)
