"""The C++ extend (prefill) attention kernel (kernels/csrc/attention/extend_attention.cpp, cpu_kernel backend) against a
float64 naive reference, in both bf16 arithmetics, and its rows' independence of the batch.

Built once per machine with the decode kernel (cached); it needs AVX-512, and these tests skip without it.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from test_attention import naive_attention, random_batch
from test_attention_cpu_kernel import bf16_arithmetic, extend_kernel, in_each_bf16_arithmetic, op  # noqa: F401 - fixtures

from sgl_lite.runtime.layers.attention import cpu_kernel
from sgl_lite.runtime.layers.attention.cpu_kernel import CpuKernelBackend
from sgl_lite.runtime.mem_cache.memory_pool import KVPool


@pytest.fixture(autouse=True)
def extends_on_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every extend through the kernel: on a CPU with AMX the backend hands bf16 ones to the AMX kernel
    (tests/test_amx_extend_attention.py) and long ones over other pools to SDPA (tests/test_amx_paths.py)."""
    monkeypatch.setattr(cpu_kernel, "amx_matmuls", lambda: False)
    monkeypatch.setattr(cpu_kernel, "amx_extend_kernel_takes", lambda *dtypes_and_dim: False)

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
    """Extend rows through kernels/csrc/attention/extend_attention.cpp (causal with the prefix offset, GQA), against a
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


def test_extend_rows_do_not_read_the_values_of_later_keys(op, bf16_arithmetic):
    """A tile's rows never multiply a later key's V, even where the pairs path packs it beside the tile's
    last key: with NaN in the V of the first key past a tile (an odd key count), that tile's rows stay
    finite and match the reference; the rows that see the key are NaN. (16 KV heads: enough items for the
    threads without splitting the request's tiles, so one packed copy holds both tiles' keys.)"""
    pool, meta, q, k, v = random_batch(9, [5], [40], 16, 16, d=64, dtype=torch.bfloat16)
    v[32] = float("nan")  # position 37: the first tile (tokens 0-31) sees positions 0-36
    backend = CpuKernelBackend(16, 16, 64, op)
    backend.prepare(meta)
    out = backend.forward(0, q, k, v, pool)
    expected = naive_attention(meta, 0, q.double(), pool)
    assert torch.isfinite(out[:32]).all()
    assert (out[:32].double() - expected[:32]).abs().max() <= 2**-7 * max(1.0, expected[:32].abs().max().item())
    assert torch.isnan(out[32:]).all()


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


def extreme_fp8_pool(seed: int, slots: int, hkv: int, d: int, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools of 8-bit floats: random values with subnormals, zeros of both signs and the largest
    magnitudes mixed in (never NaN: one NaN poisons a row's softmax)."""
    g = torch.Generator().manual_seed(seed)
    finite, tiny = torch.finfo(fp8).max, torch.finfo(fp8).smallest_normal
    pools = []
    for _ in range(2):
        x = torch.randn(slots, hkv, d, generator=g) * 2
        pick = torch.randint(0, 8, x.shape, generator=g)
        x = torch.where(pick == 0, x * tiny / 4, x)  # subnormals
        x = torch.where(pick == 1, torch.sign(x) * finite, x)
        x = torch.where(pick == 2, torch.zeros_like(x) * torch.sign(x), x)
        pools.append(x.to(fp8))
    pools[0] = (pools[0].float() / 64).to(fp8)  # K: scores stay in the tens, so no row's softmax is one-hot
    return pools[0], pools[1]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_kernel_reads_fp8_pools_as_their_values(op, fp8, dtype, bf16_arithmetic):
    """An 8-bit pool is widened in registers: every row gets the bits the kernel gives over a pool of q's
    dtype holding the same values (every fp8 value is exact there), subnormals and extremes included."""
    slots, hq, hkv, d = 300, 9, 3, 64
    k8, v8 = extreme_fp8_pool(3, slots, hkv, d, fp8)
    assert (k8.float().abs() < torch.finfo(fp8).smallest_normal).logical_and(k8.float() != 0).any()  # subnormals are there
    q = torch.randn(70, hq, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    # (first q row, new tokens, first index, kv length): a long cached prefix, a short one, a fresh prompt
    requests = torch.tensor([[0, 33, 0, 200], [33, 30, 200, 45], [63, 7, 245, 7]])
    indices = torch.randperm(slots, generator=torch.Generator().manual_seed(5))[:252]
    out8, out = torch.zeros_like(q), torch.zeros_like(q)
    torch.ops.sgl_lite.extend_attention(q, k8, v8, requests, indices, 0.125, out8)
    torch.ops.sgl_lite.extend_attention(q, k8.to(dtype), v8.to(dtype), requests, indices, 0.125, out)
    assert torch.isfinite(out8).all() and out8.abs().max() > 0
    assert torch.equal(out8, out)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_extends_read_the_pool_but_a_fresh_prompt_its_own_kv(op, kv):
    """Through the backend on an 8-bit pool: a request with a cached prefix goes through the kernel over the
    rounded pool; a prompt with nothing cached attends its own K/V before rounding (the torch path), as
    documented for --kv-cache-dtype."""
    extend_kernel()
    from sgl_lite.runtime.layers.attention.torch_native import TorchNativeBackend
    from sgl_lite.runtime.mem_cache.memory_pool import kv_cache_dtype

    pool, meta, q, k, v = random_batch(12, [0, 40], [24, 16], 9, 3, d=64, dtype=torch.bfloat16)
    fp8 = KVPool(1, pool.num_slots, 3, 64, kv_cache_dtype(kv, torch.bfloat16))
    fp8.write(0, torch.arange(1, pool.num_slots + 1), pool.k[0][1:].nan_to_num(), pool.v[0][1:].nan_to_num())
    backend = CpuKernelBackend(9, 3, 64, op)
    backend.prepare(meta)
    out = backend.forward(0, q, k, v, fp8)
    reference = TorchNativeBackend(9, 3, 64)
    reference.prepare(meta)
    assert torch.equal(out[:24], reference.forward(0, q, k, v, fp8)[:24])  # the fresh prompt: the torch path's bits
    widened = KVPool(1, pool.num_slots, 3, 64, torch.bfloat16)
    widened.k, widened.v = [fp8.k[0].to(torch.bfloat16)], [fp8.v[0].to(torch.bfloat16)]
    kernel_alone = torch.zeros_like(q)
    torch.ops.sgl_lite.extend_attention(q, widened.k[0], widened.v[0], backend._extend_table[1:], meta.kv_indices, backend.scale,
                                        kernel_alone)
    assert torch.equal(out[24:], kernel_alone[24:])  # the cached request: the kernel over the rounded pool
