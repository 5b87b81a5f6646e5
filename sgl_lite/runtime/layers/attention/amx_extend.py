"""Extend attention through torch's scaled_dot_product_attention, for CPUs whose oneDNN runs bf16 matmuls
on AMX tiles (layers/onednn.amx_matmuls), over the pools the AMX extend kernel does not read (float32, fp16
and 8-bit ones; kernels/csrc/amx_extend_attention.cpp takes bf16).

There torch's CPU flash attention computes its blocks' QK^T and PV products on the tile units and outruns
kernels/csrc/extend_attention.cpp (AVX-512 arithmetic) on long extends over a cached prefix, by more than
the cost of gathering the request's K/V out of the pool into one head-major copy (docs/performance.md,
"On CPUs with AMX"). A request's new token j sits at position prefix + j and sees positions 0..prefix + j:
a bottom-right causal mask, which SDPA's `is_causal` (top-left) gives only without a prefix, so a request
with one gets a boolean mask, built once per forward and shared by its layers. A request with nothing cached
attends this forward's own K/V rows, unrounded by an 8-bit pool, as the other paths do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Extends of fewer new tokens stay on the extend kernel: a short agent turn's few query rows do not fill
# the tiles, and the gather copy is then the larger cost.
MIN_ROWS = 64


@dataclass
class SdpaExtend:
    start: int  # first q row of the request in the batch
    end: int
    kv_slots: torch.Tensor  # int64 [prefix + extend]: the request's pool slots, in position order
    prefix: int
    mask: torch.Tensor | None  # bool [extend, prefix + extend]: True where attended; None without a prefix


def plan(start: int, end: int, kv_slots: torch.Tensor, prefix: int) -> SdpaExtend:
    extend = end - start
    mask = None
    if prefix:
        mask = torch.ones(extend, prefix + extend, dtype=torch.bool, device=kv_slots.device).tril_(diagonal=prefix)
    return SdpaExtend(start, end, kv_slots, prefix, mask)


def attend(req: SdpaExtend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           scale: float, out: torch.Tensor) -> None:
    """Write the attention of `req`'s rows of q [T, Hq, D] into `out`: over this forward's k, v [T, Hkv, D]
    rows without a prefix, else over K/V [slots, Hkv, D] read from the pool (8-bit pools widened to q's
    dtype after the gather)."""
    if req.prefix == 0:
        keys, values = k[req.start : req.end], v[req.start : req.end]
    else:
        keys, values = k_cache.index_select(0, req.kv_slots), v_cache.index_select(0, req.kv_slots)
    keys = keys.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    values = values.to(q.dtype).transpose(0, 1).unsqueeze(0)
    query = q[req.start : req.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, E, D]
    gqa = query.shape[1] != keys.shape[1]
    result = F.scaled_dot_product_attention(query, keys, values, attn_mask=req.mask, is_causal=req.mask is None,
                                            scale=scale, enable_gqa=gqa)
    out[req.start : req.end] = result[0].transpose(0, 1)
