"""The C++ extend (prefill) attention kernel (layers/csrc/extend_attention.cpp, cpu_kernel backend) against a
float64 naive reference, in both bf16 arithmetics, and its rows' independence of the batch.

Built once per machine with the decode kernel (cached); it needs AVX-512, and these tests skip without it.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from test_attention import naive_attention, random_batch
from test_attention_cpu_kernel import bf16_arithmetic, extend_kernel, in_each_bf16_arithmetic, op  # noqa: F401 - fixtures

from sgl_lite.runtime.layers.attention.cpu_kernel import CpuKernelBackend
from sgl_lite.runtime.mem_cache.memory_pool import KVPool


EXTEND_CASES = {  # (prefix_lens, extend_lens, hq, hkv, head_dim)
    "prefill": ([0, 0], [9, 40], 9, 3, 64),
    "agent_turns": ([45, 90, 3], [17, 33, 2], 9, 3, 64),  # tiles of 16 tokens, blocks of 32 keys, ragged ends
    "long_prefix": ([700], [50], 4, 4, 128),
    "head_256": ([40], [20], 4, 2, 256),
    "mqa": ([20, 5], [11, 64], 8, 1, 32),
    "wide_group": ([31], [5], 16, 1, 16),
    "mixed_with_decode": ([0, 12, 30, 7, 0], [6, 1, 5, 1, 1], 6, 2, 64),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(EXTEND_CASES))
def test_extend_kernel_matches_naive(op, case, dtype):
    """Extend rows through layers/csrc/extend_attention.cpp (causal with the prefix offset, GQA), against a
    float64 naive reference over the stored pool; decode rows of the same batch through the decode kernel."""
    extend_kernel()
    prefix_lens, extend_lens, hq, hkv, d = EXTEND_CASES[case]
    pool, meta, q, k, v = random_batch(7, prefix_lens, extend_lens, hq, hkv, d=d, dtype=dtype)
    backend = CpuKernelBackend(hq, hkv, d, op)
    backend.prepare(meta)
    assert backend._extend_table is not None and len(backend._extend_table) == sum(e > 1 for e in extend_lens)
    for layer in range(2):
        out = backend.forward(layer, q, k, v, pool)
        expected = naive_attention(meta, layer, q.double(), pool)  # float64 over the pool as stored
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # float32 sums; or one bf16 rounding of the output
        assert (out.double() - expected).abs().max() <= tolerance * max(1.0, expected.abs().max().item())


def first_request_alone(backend: CpuKernelBackend, q: torch.Tensor, pool: KVPool, meta) -> torch.Tensor:
    """The first extend request of a prepared batch through the kernel by itself, on one thread (its rows of
    the result; the others stay zero)."""
    alone = torch.zeros_like(q)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.ops.sgl_lite.extend_attention(q, pool.k[0], pool.v[0], backend._extend_table[:1].contiguous(), meta.kv_indices,
                                            backend.scale, alone)
    finally:
        torch.set_num_threads(threads)
    return alone


@pytest.mark.parametrize("case", sorted(EXTEND_CASES))
def test_bf16_extend_kernel_matches_naive_in_each_arithmetic(op, case, bf16_arithmetic):
    """Both arithmetics of the bf16 kernel within one bf16 rounding of the float64 reference (the pairs
    path also rounds the probabilities to bf16), and each a request's rows whatever the batch and threads."""
    prefix_lens, extend_lens, hq, hkv, d = EXTEND_CASES[case]
    pool, meta, q, k, v = random_batch(7, prefix_lens, extend_lens, hq, hkv, d=d, dtype=torch.bfloat16)
    backend = CpuKernelBackend(hq, hkv, d, op)
    backend.prepare(meta)
    out = backend.forward(0, q, k, v, pool)
    expected = naive_attention(meta, 0, q.double(), pool)
    assert (out.double() - expected).abs().max() <= 2**-7 * max(1.0, expected.abs().max().item())
    first = backend._extend_table[0].tolist()
    rows = slice(first[0], first[0] + first[1])
    assert torch.equal(first_request_alone(backend, q, pool, meta)[rows], out[rows])


def test_bf16_extend_arithmetics_differ_where_pairs_apply(op):
    """The switch is real: at head size 64 the pairs path rounds probabilities to bf16, so some output bits
    differ from the FMA path's; at head size 16 (not a multiple of 32) both run the FMA path."""
    extend_kernel()
    outs: dict[int, dict[str, torch.Tensor]] = {}
    for d in (64, 16):
        pool, meta, q, k, v = random_batch(11, [30], [40], 8, 2, d=d, dtype=torch.bfloat16)
        backend = CpuKernelBackend(8, 2, d, op)
        backend.prepare(meta)
        outs[d] = in_each_bf16_arithmetic(partial(backend.forward, 0, q, k, v, pool))
    assert not torch.equal(outs[64]["fma"], outs[64]["dpbf16"])
    assert torch.equal(outs[16]["fma"], outs[16]["dpbf16"])


def test_extend_kernel_rows_do_not_depend_on_the_batch(op):
    """A request's extend rows are the same bits alone and beside others, with one thread or two."""
    extend_kernel()
    pool, meta, q, k, v = random_batch(8, [40, 7], [33, 20], 9, 3, d=64, dtype=torch.bfloat16)
    backend = CpuKernelBackend(9, 3, 64, op)
    backend.prepare(meta)
    both = backend.forward(0, q, k, v, pool)
    assert torch.equal(first_request_alone(backend, q, pool, meta)[:33], both[:33])


def test_extend_kernel_rejects_bad_metadata(op):
    extend_kernel()
    pool, meta, q, k, v = random_batch(9, [4], [6], 4, 2, d=16)
    ext = torch.ops.sgl_lite.extend_attention
    out = torch.empty_like(q)
    good = torch.tensor([[0, 6, 0, 10]])
    ext(q, pool.k[0], pool.v[0], good, meta.kv_indices, 0.25, out)
    with pytest.raises(RuntimeError, match="out of range"):
        ext(q, pool.k[0], pool.v[0], torch.tensor([[0, 7, 0, 10]]), meta.kv_indices, 0.25, out)  # more q rows than q has
    with pytest.raises(RuntimeError, match="out of range"):
        ext(q, pool.k[0], pool.v[0], torch.tensor([[0, 6, 0, 11]]), meta.kv_indices, 0.25, out)  # past kv_indices
    with pytest.raises(RuntimeError, match="slot outside"):
        ext(q, pool.k[0], pool.v[0], good, torch.full((10,), pool.num_slots + 5), 0.25, out)
    with pytest.raises(RuntimeError, match="int64 \\[E, 4\\]"):
        ext(q, pool.k[0], pool.v[0], good.int(), meta.kv_indices, 0.25, out)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ext(q.bfloat16(), pool.k[0], pool.v[0], good, meta.kv_indices, 0.25, out.bfloat16())
