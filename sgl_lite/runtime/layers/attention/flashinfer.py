"""FlashInfer adapter (CUDA only): maps AttentionMetadata onto FlashInfer's paged-KV wrappers.

BatchPrefillWithPagedKVCacheWrapper / BatchDecodeWithPagedKVCacheWrapper, `plan()` once per batch then `run()`
per layer, kv_layout "NHD". With page size 1 our per-layer K/V tensors [num_slots + 1, Hkv, D] are viewed as
[num_pages, page_size=1, Hkv, D], paged_kv_indptr = kv_indptr, paged_kv_indices = kv_indices and
paged_kv_last_page_len = ones. The indptrs go to plan() as host tensors built from the batch's Python lists:
plan() reads them on the host, and a device copy would cost a synchronisation every step.

FlashInferGraphDecode is the decode wrapper one captured CUDA graph replays (model_executor/cuda_graph_runner.py):
fixed index buffers, planned outside the graph before capture and before every replay.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from sgl_lite.runtime.layers.attention.base import AttentionBackend, AttentionMetadata
from sgl_lite.runtime.mem_cache.memory_pool import KVPool

_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class FlashInferPlan:
    """Exactly the arguments handed to the wrapper's plan() (checked by CPU unit tests)."""

    is_decode: bool
    qo_indptr: torch.Tensor  # int32 [B+1], on the host
    paged_kv_indptr: torch.Tensor  # int32 [B+1], on the host
    paged_kv_indices: torch.Tensor  # int32 [total_kv], on the KV pool's device
    paged_kv_last_page_len: torch.Tensor  # int32 [B], all ones (page size 1), on the host


def plan_arguments(meta: AttentionMetadata) -> FlashInferPlan:
    seq_lens = [p + e for p, e in zip(meta.prefix_lens, meta.extend_lens)]
    return FlashInferPlan(
        is_decode=meta.is_decode,
        qo_indptr=torch.tensor([0, *itertools.accumulate(meta.extend_lens)], dtype=torch.int32),
        paged_kv_indptr=torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32),
        paged_kv_indices=meta.kv_indices.to(torch.int32),
        paged_kv_last_page_len=torch.ones(meta.batch_size, dtype=torch.int32),
    )


def flashinfer_workspace(device: torch.device) -> torch.Tensor:
    """FlashInfer's float workspace: scratch for split-KV partial results, shared by wrappers that never run at once."""
    return torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


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
        workspace = flashinfer_workspace(device)
        # fa2, not "auto" (which picks FA3 on Hopper for 16-bit KV): FA3's module takes minutes to JIT-compile
        # (docs/gpu.md), and fa2 serves the 8-bit pools too, so one kind of module covers both.
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._wrapper = None
        self._meta: AttentionMetadata | None = None
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


class FlashInferGraphDecode(AttentionBackend):
    """Decode attention of exactly `batch_size` requests for one CUDA graph: FlashInfer's graph-safe decode
    wrapper reads fixed index buffers, and K/V are written at a fixed slot buffer, so a replay reads what
    `prepare` last put there. `prepare` (outside the graph) copies the batch's slots in and plans; `forward`
    only launches kernels, so it can be captured. `kv_indices` (int32, on the device) holds the batch's slots:
    its size bounds the batch's total sequence length."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, batch_size: int, kv_indices: torch.Tensor,
                 q_dtype: torch.dtype, kv_dtype: torch.dtype, workspace: torch.Tensor, scale: float | None = None) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, scale)
        flashinfer = _import_flashinfer()
        device = workspace.device
        self.batch_size = batch_size
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.out_cache_loc = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self._last_page_len = torch.ones(batch_size, dtype=torch.int32)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=kv_indices,
            paged_kv_last_page_len_buffer=torch.ones(batch_size, dtype=torch.int32, device=device),
        )

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.batch_size != self.batch_size or not meta.is_decode:
            raise ValueError(f"a graph's decode attention takes {self.batch_size} decode rows; got {meta.extend_lens}")
        plan = plan_arguments(meta)
        self.out_cache_loc.copy_(meta.out_cache_loc, non_blocking=True)
        self._wrapper.plan(plan.paged_kv_indptr, plan.paged_kv_indices, self._last_page_len, self.num_q_heads,
                           self.num_kv_heads, self.head_dim, page_size=1, q_data_type=self.q_dtype,
                           kv_data_type=self.kv_dtype, sm_scale=self.scale)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_pool: KVPool) -> torch.Tensor:
        kv_pool.write(layer_id, self.out_cache_loc, k, v)
        return self._wrapper.run(q.contiguous(), (kv_pool.k[layer_id].unsqueeze(1), kv_pool.v[layer_id].unsqueeze(1)))
