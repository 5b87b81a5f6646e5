"""The `cpu_kernel` attention backend: decode rows and extend chunks through C++ paged kernels.

Decode (one new token per request) is where CPU serving spends most of its attention time, and there the
torch path pays for a gather copy of every request's K/V per layer plus small per-request matmuls. The
kernel (kernels/csrc/attention/paged_decode_attention.cpp, built by kernels/loader.py) reads each KV row once, straight
from the pool through FlashInfer's kv_indptr / kv_indices, for the whole GQA query group, and converts
8-bit pools in registers; the few tokens of a speculative verification row (meta.verify_rows) go through
it as one row of several queries, which share its reads of K/V and each give the bits of that token
decoded alone. Prefill and extend chunks (an agent's next turn over its cached conversation)
go through kernels/csrc/attention/extend_attention.cpp, flash attention's online softmax in float32 over the same
metadata, where it is built (AVX-512); else the torch path. On a CPU with AMX, extends of bf16 queries over
a bf16 pool go through kernels/csrc/attention/amx_extend_attention.cpp instead (the products on the tile units,
faster at every extend length), and long extends over other pools through torch's SDPA (amx_extend.py).
An 8-bit pool is widened in registers by both AVX-512 kernels; a prompt with nothing cached still attends
its own K/V unrounded there (the torch path), as documented for `--kv-cache-dtype`, and every later token
reads the pool.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sgl_lite.runtime.kernels import ops
from sgl_lite.runtime.layers.attention import amx_extend
from sgl_lite.runtime.layers.attention.base import AttentionMetadata, DecodeKernelInputs
from sgl_lite.runtime.layers.attention.torch_native import ExtendReq, TorchNativeBackend
from sgl_lite.runtime.layers.onednn import amx_matmuls
from sgl_lite.runtime.mem_cache.memory_pool import FP8_KV_DTYPES, KVPool

# The kernel's compile-time limits (kMaxHeadDim, kLanes, kMaxGroup in the C++ source).
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 16
MAX_GROUP = 16
EXTEND_HEAD_DIMS = (16, 32, 64, 128, 256)  # the extend kernel's compiled head sizes


@dataclass
class _KernelDecodeGroup:
    rows: torch.Tensor | None  # q rows of the decode and verification requests; None when they are the whole batch
    kv_indptr: torch.Tensor  # int32 [G+1]
    kv_indices: torch.Tensor  # int64 [total_kv]
    qo_indptr: torch.Tensor | None  # int32 [G+1]: each request's queries among those rows; None when one each


@functools.cache
def extend_kernel_available() -> bool:
    """Whether kernels/csrc/attention/extend_attention.cpp is built here (it needs AVX-512)."""
    from sgl_lite.runtime.kernels.loader import runs_here

    return runs_here("extend_attention")


@functools.cache
def amx_extend_kernel_available() -> bool:
    """Whether kernels/csrc/attention/amx_extend_attention.cpp is built here and this process may use AMX tiles."""
    from sgl_lite.runtime.kernels.loader import runs_here

    return runs_here("amx_extend_attention")


def amx_extend_kernel_takes(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether extends run on the AMX kernel: bf16 queries over a bf16 pool, head_dim a multiple of 32 (up
    to MAX_HEAD_DIM), this CPU's tiles."""
    return q_dtype == kv_dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM and amx_extend_kernel_available()


def kernel_supports(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0 and num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= MAX_GROUP


class CpuKernelBackend(TorchNativeBackend):
    def __init__(
        self, num_q_heads: int, num_kv_heads: int, head_dim: int, op: Callable[..., torch.Tensor], scale: float | None = None
    ) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, scale)
        if not kernel_supports(num_q_heads, num_kv_heads, head_dim):
            raise ValueError(
                f"the CPU decode kernel takes head_dim <= {MAX_HEAD_DIM}, a multiple of {HEAD_DIM_MULTIPLE}, and <= {MAX_GROUP} query heads per KV head; "
                f"got head_dim {head_dim}, {num_q_heads} query and {num_kv_heads} KV heads"
            )
        self._op = op
        self._extend_table: torch.Tensor | None = None  # int64 [E, 4] for the extend kernel (see prepare)
        # Where a forward's extends go when the AMX kernel does not take its pool: long ones to SDPA with their
        # causal masks, short ones to the extend kernel's table; split on the forward's first layer
        self._sdpa_extends: list[tuple[ExtendReq, torch.Tensor | None]] | None = None
        self._short_extends: tuple[list[ExtendReq], torch.Tensor | None] | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        self._extend_table = None
        self._sdpa_extends = self._short_extends = None
        if self._extends and (self._avx512_extends() or amx_extend_kernel_takes(torch.bfloat16, torch.bfloat16, self.head_dim)):
            qo, kv = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
            rows = [(qo[i], e, kv[i], kv[i + 1] - kv[i]) for i, e in enumerate(meta.extend_lens) if e > 1 and i not in meta.verify_rows]
            self._extend_table = torch.tensor(rows, dtype=torch.int64)

    def _extend_all(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor) -> None:
        if not self._extends:
            return
        table = self._extend_table
        if table is not None and amx_extend_kernel_takes(q.dtype, k_cache.dtype, self.head_dim):
            ops.amx_extend_attention(q, k_cache, v_cache, table, self._meta.kv_indices, self.scale, out)
            return
        if self._short_extends is None:
            self._split_extends()
        for req, mask in self._sdpa_extends:
            amx_extend.attend(req, mask, q, k, v, k_cache, v_cache, self.scale, out)
        extends, table = self._short_extends
        if not extends:
            return
        if table is None or not self._avx512_extends():
            for req in extends:
                self._extend_attention(q, k, v, k_cache, v_cache, req, out)
            return
        if k_cache.dtype in FP8_KV_DTYPES.values():  # a prompt with nothing cached attends its own unrounded K/V
            for req in extends:
                if req.prefix == 0:
                    self._extend_attention(q, k, v, k_cache, v_cache, req, out)
            table = table[table[:, 3] > table[:, 1]]  # the rows of requests with a cached prefix (kv length > new)
            if not len(table):
                return
        ops.extend_attention(q, k_cache, v_cache, table, self._meta.kv_indices, self.scale, out)

    def _split_extends(self) -> None:
        """With AMX, long extends through SDPA (whose blocks' products run on the tiles), the rest on the
        extend kernel; without it, every extend on the kernel."""
        amx = amx_matmuls()
        long = [r for r in self._extends if amx and r.end - r.start >= amx_extend.MIN_ROWS]
        self._sdpa_extends = [(r, amx_extend.causal_mask(r)) for r in long]
        table = self._extend_table
        if long and table is not None:
            table = table[table[:, 1] < amx_extend.MIN_ROWS]
        short = [r for r in self._extends if not (amx and r.end - r.start >= amx_extend.MIN_ROWS)]
        self._short_extends = (short, table)

    def _avx512_extends(self) -> bool:
        """Whether kernels/csrc/attention/extend_attention.cpp takes this head size here."""
        return self.head_dim in EXTEND_HEAD_DIMS and extend_kernel_available()

    def _prepare_decode(self, meta: AttentionMetadata, single: list[int]) -> _KernelDecodeGroup:
        # A verification row is one kernel row of several queries: they share its reads of K/V.
        qo_indptr = None if meta.is_decode else meta.qo_indptr
        if len(single) == meta.batch_size:
            return _KernelDecodeGroup(rows=None, kv_indptr=meta.kv_indptr, kv_indices=meta.kv_indices, qo_indptr=qo_indptr)
        device = meta.padded_kv_indices.device
        rows, _, _ = meta.decode_queries(single)
        idx = torch.tensor(single, dtype=torch.int64, device=device)
        seq = meta.seq_lens[idx]
        slots = meta.padded_kv_indices[idx, : int(seq.max())]
        valid = torch.arange(slots.shape[1], device=device)[None, :] < seq[:, None]
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        extend = torch.tensor([meta.extend_lens[i] for i in single], dtype=torch.int32, device=device)
        return _KernelDecodeGroup(
            rows=rows,
            kv_indptr=torch.cat((zero, torch.cumsum(seq, 0).to(torch.int32))),
            kv_indices=slots[valid],
            qo_indptr=torch.cat((zero, torch.cumsum(extend, 0).to(torch.int32))),
        )

    def _decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _KernelDecodeGroup
    ) -> torch.Tensor:
        return self._op(q.contiguous(), k_cache, v_cache, group.kv_indptr, group.kv_indices, self.scale, group.qo_indptr)

    def decode_kernel_inputs(self, kv_pool: KVPool) -> DecodeKernelInputs | None:
        group, meta = self._decode, self._meta
        # the whole batch decode or verification rows (the fused layer stores into any pool, 8-bit ones too)
        if meta is None or not isinstance(group, _KernelDecodeGroup) or group.rows is not None or self._extends:
            return None
        return DecodeKernelInputs(meta.out_cache_loc, group.kv_indptr, group.kv_indices, self.scale, group.qo_indptr)
