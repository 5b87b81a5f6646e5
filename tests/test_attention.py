"""Attention metadata and backends: torch_native against a naive per-token reference on random batches."""

from __future__ import annotations

import pytest
import torch

from sgl_lite.runtime.layers.attention import AttentionMetadata, TorchNativeBackend, create_backend
from sgl_lite.runtime.layers.attention.flashinfer import FlashInferBackend, plan_arguments
from sgl_lite.runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool, SlotAllocator

ATOL = 1e-5


def random_batch(
    seed: int, prefix_lens: list[int], extend_lens: list[int], hq: int, hkv: int, d: int = 16, dtype: torch.dtype = torch.float32,
    verify_rows: list[int] | None = None,
):
    """Fill prefixes with random KV in random slots; return everything a forward needs.

    Every slot but padding slot 0 starts as NaN (what an uninitialized pool may hold), so reading a
    slot that was never written, or a padding slot other than 0, poisons the output.
    """
    g = torch.Generator().manual_seed(seed)
    num_slots = 4 * (sum(prefix_lens) + sum(extend_lens)) + 8
    pool = KVPool(num_layers=2, num_slots=num_slots, kv_heads=hkv, head_dim=d, dtype=dtype)
    for tensor in (*pool.k, *pool.v):
        tensor[1:] = float("nan")
    table = ReqToTokenPool(max_requests=len(prefix_lens) + 2, max_context=max(128, *(p + e for p, e in zip(prefix_lens, extend_lens))))
    alloc = SlotAllocator(num_slots)
    alloc._free = alloc._free[torch.randperm(num_slots, generator=g)]  # scattered slots, as after eviction
    rows, new_slots = [], []
    for prefix, extend in zip(prefix_lens, extend_lens):
        row = table.alloc()
        slots = alloc.alloc(prefix + extend)
        table.table[row, : prefix + extend] = slots
        for layer in range(2):
            keys, values = torch.randn(prefix, hkv, d, generator=g), torch.randn(prefix, hkv, d, generator=g)
            pool.write(layer, slots[:prefix], keys.to(dtype), values.to(dtype))
        rows.append(row)
        new_slots.append(slots[prefix:])
    n = sum(extend_lens)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    meta = AttentionMetadata.build(rows, prefix_lens, extend_lens, torch.cat(new_slots), table, verify_rows=verify_rows)
    return pool, meta, q, k, v


def naive_attention(meta: AttentionMetadata, layer: int, q: torch.Tensor, pool: KVPool) -> torch.Tensor:
    """Per request, per query token: softmax over the slots it may see (pool already holds the new KV)."""
    hq, hkv = q.shape[1], pool.kv_heads
    out = torch.empty_like(q)
    qo, kv = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    for i, prefix in enumerate(meta.prefix_lens):
        slots = meta.kv_indices[kv[i] : kv[i + 1]]
        for j in range(qo[i + 1] - qo[i]):
            visible = slots[: prefix + j + 1]
            for h in range(hq):
                keys = pool.k[layer][visible, h // (hq // hkv)].double()
                values = pool.v[layer][visible, h // (hq // hkv)].double()
                w = torch.softmax(keys @ q[qo[i] + j, h].double() / q.shape[-1] ** 0.5, dim=0)
                out[qo[i] + j, h] = (w @ values).to(q.dtype)
    return out


CASES = {
    "decode_only": ([5, 17, 1, 40], [1, 1, 1, 1], 4, 2),
    "prefill_only": ([0, 0], [9, 3], 4, 4),
    "mixed_extend_decode": ([0, 12, 30, 7, 0], [6, 1, 5, 1, 1], 6, 2),
    "mqa_chunk": ([20], [11], 8, 1),
    # several query tiles per request: 128-row tiles, and shorter ones once the context is long
    "extend_tiles": ([100, 0, 3], [300, 150, 1], 6, 2),
    "extend_long_context": ([1500], [100], 8, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_native_matches_naive(case):
    prefix_lens, extend_lens, hq, hkv = CASES[case]
    pool, meta, q, k, v = random_batch(len(case), prefix_lens, extend_lens, hq, hkv)
    backend = TorchNativeBackend(hq, hkv, q.shape[-1])
    backend.prepare(meta)
    for layer in range(2):
        out = backend.forward(layer, q, k, v, pool)
        assert torch.equal(pool.k[layer][meta.out_cache_loc], k) and torch.equal(pool.v[layer][meta.out_cache_loc], v)
        expected = naive_attention(meta, layer, q, pool)
        assert (out - expected).abs().max() < ATOL


# bf16: the decode path runs its matmuls in bf16 (softmax in float32); tolerance is bf16 rounding of
# q, k, probabilities and output against a float64 reference on the same bf16 inputs.
BF16_ATOL = 3e-2
DECODE_HEAVY = {
    "decode_uneven_gqa": ([3, 60, 17, 0, 41, 8], [1, 1, 1, 1, 1, 1], 9, 3),
    "decode_mixed_gqa": ([33, 0, 5, 12, 0, 70], [1, 7, 1, 4, 1, 1], 9, 3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(DECODE_HEAVY))
def test_decode_gather_path_matches_naive(case, dtype):
    """The one-gather-per-layer decode path (head-major rows, padded to the longest sequence) with GQA,
    uneven lengths, an empty-prefix decode row, and extend rows in the same batch."""
    prefix_lens, extend_lens, hq, hkv = DECODE_HEAVY[case]
    pool, meta, q, k, v = random_batch(7, prefix_lens, extend_lens, hq, hkv, d=64, dtype=dtype)
    backend = TorchNativeBackend(hq, hkv, q.shape[-1])
    backend.prepare(meta)
    for layer in range(2):
        out = backend.forward(layer, q, k, v, pool)
        assert out.dtype == dtype and torch.isfinite(out).all()
        expected = naive_attention(meta, layer, q, pool)
        assert (out.float() - expected.float()).abs().max() < (ATOL if dtype == torch.float32 else BF16_ATOL)


# Speculative verification rows (several tokens over a cached prefix) run as one decode query per token.
VERIFY = {
    "verify_and_decode": ([33, 0, 5, 12, 40], [5, 7, 1, 3, 1], [0, 3]),
    "verify_only_in_order": ([9, 60, 2], [3, 5, 2], [0, 1, 2]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(VERIFY))
def test_verify_rows_take_the_decode_path_and_match_naive(case, dtype):
    prefix_lens, extend_lens, verify = VERIFY[case]
    pool, meta, q, k, v = random_batch(5, prefix_lens, extend_lens, 9, 3, d=32, dtype=dtype, verify_rows=verify)
    backend = TorchNativeBackend(9, 3, 32)
    backend.prepare(meta)
    assert all(e.start not in meta.qo_indptr[verify].tolist() for e in backend._extends)
    for layer in range(2):
        out = backend.forward(layer, q, k, v, pool)
        expected = naive_attention(meta, layer, q, pool)
        assert (out.float() - expected.float()).abs().max() < (ATOL if dtype == torch.float32 else BF16_ATOL)


def test_kv_pool_padding_slot_is_zero():
    pool = KVPool(num_layers=3, num_slots=5, kv_heads=2, head_dim=4, dtype=torch.bfloat16)
    for tensor in (*pool.k, *pool.v):
        assert tensor.shape == (6, 2, 4) and torch.equal(tensor[0], torch.zeros(2, 4, dtype=torch.bfloat16))


def test_metadata_layout():
    pool, meta, q, k, v = random_batch(0, [3, 0, 5], [2, 4, 1], 2, 1)
    assert meta.qo_indptr.tolist() == [0, 2, 6, 7]
    assert meta.kv_indptr.tolist() == [0, 5, 9, 15]
    assert meta.batch_size == 3 and meta.num_tokens == 7 and not meta.is_decode
    assert meta.max_kv_len == 6 and meta.max_extend_len == 4
    kv = meta.kv_indptr.tolist()
    # the new tokens' slots are the tail of each request's kv_indices, in order
    tails = [meta.kv_indices[kv[i + 1] - e : kv[i + 1]] for i, e in enumerate(meta.extend_lens)]
    assert torch.equal(torch.cat(tails), meta.out_cache_loc)
    assert (meta.kv_indices > 0).all()  # slot 0 is padding only


def test_metadata_rejects_bad_input():
    table = ReqToTokenPool(max_requests=2, max_context=8)
    with pytest.raises(ValueError, match="out_cache_loc has 2 slots"):
        AttentionMetadata.build([0], [0], [3], torch.tensor([1, 2]), table)
    with pytest.raises(ValueError, match="context length 8"):
        AttentionMetadata.build([0], [6], [3], torch.tensor([1, 2, 3]), table)


def test_flashinfer_plan_arguments_are_page_size_one():
    pool, meta, q, k, v = random_batch(1, [4, 0, 9], [1, 3, 2], 4, 2)
    plan = plan_arguments(meta)
    assert not plan.is_decode
    for t in (plan.qo_indptr, plan.paged_kv_indptr, plan.paged_kv_indices, plan.paged_kv_last_page_len):
        assert t.dtype == torch.int32
    assert plan.paged_kv_last_page_len.tolist() == [1, 1, 1]
    assert plan.paged_kv_indptr[-1].item() == plan.paged_kv_indices.numel()
    assert torch.equal(plan.paged_kv_indices.long(), meta.kv_indices)
    # per-request page counts equal the sequence lengths (one token per page)
    assert torch.diff(plan.paged_kv_indptr).tolist() == [5, 3, 11]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_flashinfer_without_cuda_raises_clear_error():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        FlashInferBackend(4, 2, 16, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs CUDA"):
        create_backend("flashinfer", torch.device("cpu"), 4, 2, 16)
    assert isinstance(create_backend("auto", torch.device("cpu"), 4, 2, 16), TorchNativeBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("xformers", torch.device("cpu"), 4, 2, 16)
