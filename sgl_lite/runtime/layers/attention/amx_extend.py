"""Extend attention through torch's scaled_dot_product_attention, for CPUs whose oneDNN runs bf16 matmuls
on AMX tiles (layers/onednn.amx_matmuls), over the pools the AMX extend kernel does not read (float32, fp16
and 8-bit ones; kernels/csrc/attention/amx_extend_attention.cpp takes bf16).

There torch's CPU flash attention computes its blocks' QK^T and PV products on the tile units and outruns
kernels/csrc/attention/extend_attention.cpp (AVX-512 arithmetic) on long extends over a cached prefix, by more than
the cost of gathering the request's K/V out of the pool into one head-major copy (docs/performance.md,
"On CPUs with AMX"). A request's new token j sits at position prefix + j and sees positions 0..prefix + j:
a bottom-right causal mask, which SDPA's `is_causal` (top-left) gives only without a prefix, so a request
with one gets a boolean mask, built once per forward and shared by its layers. A request with nothing cached
attends this forward's own K/V rows, unrounded by an 8-bit pool, as the other paths do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_lite.runtime.layers.attention.torch_native import ExtendReq

# Extends of fewer new tokens stay on the extend kernel: a short agent turn's few query rows do not fill
# the tiles, and the gather copy is then the larger cost.
MIN_ROWS = 64


def causal_mask(req: ExtendReq) -> torch.Tensor | None:
    """bool [extend, prefix + extend], True where `req`'s rows attend; None without a prefix (SDPA's is_causal)."""
    if not req.prefix:
        return None
    extend = req.end - req.start
    return torch.ones(extend, req.prefix + extend, dtype=torch.bool, device=req.kv_slots.device).tril_(diagonal=req.prefix)


def attend(req: ExtendReq, mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Write the attention of `req`'s rows of q [T, Hq, D] into `out` (`mask`: its causal_mask): over this forward's k, v [T, Hkv, D]
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
    result = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=mask is None,
                                            scale=scale, enable_gqa=gqa)
    out[req.start : req.end] = result[0].transpose(0, 1)
