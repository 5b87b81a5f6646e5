"""FlashInfer adapter (CUDA only): maps AttentionMetadata onto FlashInfer's paged-KV wrappers.

Written against FlashInfer's documented API (BatchPrefillWithPagedKVCacheWrapper /
BatchDecodeWithPagedKVCacheWrapper, `plan()` once per batch then `run()` per layer, kv_layout "NHD").
With page size 1 our per-layer K/V tensors [num_slots + 1, Hkv, D] are viewed as
[num_pages, page_size=1, Hkv, D], paged_kv_indptr = kv_indptr, paged_kv_indices = kv_indices and
paged_kv_last_page_len = ones. No GPU exists on the build machines: this path is not exercised there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_lite.runtime.layers.attention.base import AttentionBackend, AttentionMetadata
from sgl_lite.runtime.mem_cache.memory_pool import KVPool

_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class FlashInferPlan:
    """Exactly the arguments handed to the wrapper's plan() (checked by CPU unit tests)."""

    is_decode: bool
    qo_indptr: torch.Tensor  # int32 [B+1]
    paged_kv_indptr: torch.Tensor  # int32 [B+1]
    paged_kv_indices: torch.Tensor  # int32 [total_kv]
    paged_kv_last_page_len: torch.Tensor  # int32 [B], all ones (page size 1)


def plan_arguments(meta: AttentionMetadata) -> FlashInferPlan:
    return FlashInferPlan(
        is_decode=meta.is_decode,
        qo_indptr=meta.qo_indptr.to(torch.int32),
        paged_kv_indptr=meta.kv_indptr.to(torch.int32),
        paged_kv_indices=meta.kv_indices.to(torch.int32),
        paged_kv_last_page_len=torch.ones(meta.batch_size, dtype=torch.int32, device=meta.kv_indptr.device),
    )


def _import_flashinfer():
    if not torch.cuda.is_available():
        raise RuntimeError("the flashinfer attention backend needs CUDA; use --attention-backend torch_native on CPU")
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError("the flashinfer attention backend needs the flashinfer-python package (pip install sgl-lite[cuda])") from e
    return flashinfer


class FlashInferBackend(AttentionBackend):
    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device, scale: float | None = None) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, scale)
        flashinfer = _import_flashinfer()
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._wrapper = None
        self._meta: AttentionMetadata | None = None
        self._planned_dtype: torch.dtype | None = None
        self._plan: FlashInferPlan | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._plan = plan_arguments(meta)
        self._wrapper = None  # planned lazily on the first layer, when q/kv dtypes are known

    def _plan_wrapper(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        plan = self._plan
        common = dict(page_size=1, q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=self.scale)
        if plan.is_decode:
            self._decode.plan(
                plan.paged_kv_indptr, plan.paged_kv_indices, plan.paged_kv_last_page_len,
                self.num_q_heads, self.num_kv_heads, self.head_dim, **common,
            )
            self._wrapper = self._decode
        else:
            self._prefill.plan(
                plan.qo_indptr, plan.paged_kv_indptr, plan.paged_kv_indices, plan.paged_kv_last_page_len,
                self.num_q_heads, self.num_kv_heads, self.head_dim, causal=True, **common,
            )
            self._wrapper = self._prefill

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        if self._meta is None:
            raise RuntimeError("FlashInferBackend.forward called before prepare()")
        kv_pool.write(layer_id, self._meta.out_cache_loc, k, v)
        if self._wrapper is None:
            self._plan_wrapper(q.dtype, kv_pool.dtype)
        k_cache = kv_pool.k[layer_id].unsqueeze(1)  # [num_pages, page_size=1, Hkv, D]
        v_cache = kv_pool.v[layer_id].unsqueeze(1)
        return self._wrapper.run(q.contiguous(), (k_cache, v_cache))
