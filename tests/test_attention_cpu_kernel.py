"""The C++ paged decode kernel (cpu_kernel backend) against float64 references and the torch path.

The op is built once per machine (cached); these tests fail rather than skip when it cannot be built,
since CI runs on the machine class it targets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import pytest
import torch
from test_attention import naive_attention, random_batch

from sgl_lite.runtime.kernels import loader, ops
from sgl_lite.runtime.layers.attention import TorchNativeBackend, create_backend
from sgl_lite.runtime.layers.attention.cpu_kernel import CpuKernelBackend
from sgl_lite.runtime.mem_cache.memory_pool import KVPool, kv_cache_dtype
from sgl_lite.runtime.server_args import ServerArgs

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def op():
    assert loader.has_op("paged_decode_attention"), "the CPU decode kernel did not build on this machine"
    return ops.paged_decode_attention


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
              scale: float) -> torch.Tensor:
    """float64 softmax(q K^T * scale) V per request and query head over the cache as stored (8-bit values exactly)."""
    num, hq, _ = q.shape
    group = hq // k_cache.shape[1]
    kc, vc = k_cache.double(), v_cache.double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(num):
        slots = indices[indptr[b] : indptr[b + 1]]
        keys, values = kc[slots], vc[slots]  # [L, Hkv, D]
        for h in range(hq):
            w = torch.softmax(keys[:, h // group] @ q[b, h].double() * scale, dim=0)
            out[b, h] = w @ values[:, h // group]
    return out


def random_paged_inputs(seed: int, lens: list[int], hq: int, hkv: int, dim: int, dtype: torch.dtype, kv_dtype: torch.dtype):
    """A pool with twice the needed slots plus padding slot 0, each request's slots a random subset (as after eviction)."""
    g = torch.Generator().manual_seed(seed)
    num_slots = 2 * sum(lens) + 1
    k_cache = (torch.randn(num_slots, hkv, dim, generator=g) * 2).to(kv_dtype)
    v_cache = torch.randn(num_slots, hkv, dim, generator=g).to(kv_dtype)
    indices = (torch.randperm(num_slots - 1, generator=g)[: sum(lens)] + 1).to(torch.int64)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(len(lens), hq, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, indptr, indices


# (lengths, hq, hkv, dim): GQA groups 1..8, MQA, the model's 9/3 at dim 64, lengths 1..4096 (long ones are
# split into chunks whose partial softmax states are merged).
SHAPES = {
    "smollm_gqa3": ([1, 2, 37, 300, 1000], 9, 3, 64),
    "long_4k_split": ([4096], 8, 2, 128),
    "many_short_mha": ([1, 3, 17, 31, 33, 64, 65, 5], 4, 4, 32),
    "mqa_group8_uneven": ([2048, 1, 700, 260], 8, 1, 16),
}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}  # bf16: one rounding of the output (|out| < 2)


@pytest.mark.parametrize("kv", ["same", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_kernel_matches_float64_reference(op, shape, dtype, kv):
    lens, hq, hkv, dim = SHAPES[shape]
    kv_dtype = dtype if kv == "same" else FP8[kv]
    q, k_cache, v_cache, indptr, indices = random_paged_inputs(len(shape), lens, hq, hkv, dim, dtype, kv_dtype)
    out = op(q, k_cache, v_cache, indptr, indices, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, k_cache, v_cache, indptr, indices, dim**-0.5)
    assert (out.double() - expected).abs().max() < TOLERANCE[dtype]


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_fp8_decode_is_exact_for_every_code(op, fmt):
    """One slot per request: the output is that slot's V row, so it must equal torch's own fp8 -> fp32 conversion
    for all 256 codes (subnormals, zeros of both signs, inf and NaN included)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8[fmt]).reshape(16, 1, 16)  # 16 requests x 16 dims
    k_cache = torch.zeros(16, 1, 16, dtype=FP8[fmt])
    q = torch.ones(16, 1, 16)
    out = op(q, k_cache, codes, torch.arange(17, dtype=torch.int32), torch.arange(16), 1.0)
    torch.testing.assert_close(out, codes.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("shape", ["smollm_gqa3", "long_4k_split"])
def test_fp8_pool_gives_the_bits_of_a_bf16_pool_with_its_values(op, fmt, shape):
    """bf16 queries over an 8-bit pool (widened as it is read) and over a bf16 pool holding the same values
    (every fp8 value is a bf16 value): the same bits in each arithmetic, for decode rows and a verification
    row alike. Subnormals, zeros and the format's extremes are in the pool."""
    lens, hq, hkv, dim = SHAPES[shape]
    q, k8, v8, indptr, indices = random_paged_inputs(6, lens, hq, hkv, dim, torch.bfloat16, FP8[fmt])
    g = torch.Generator().manual_seed(7)
    pick = torch.randint(0, 8, v8.shape, generator=g)
    tiny, finite = torch.finfo(FP8[fmt]).smallest_normal, torch.finfo(FP8[fmt]).max
    v = v8.float()
    v = torch.where(pick == 0, v * tiny / 4, torch.where(pick == 1, torch.sign(v) * finite, torch.where(pick == 2, -0.0 * v, v)))
    v8 = v.to(FP8[fmt])
    qo = torch.arange(len(lens) + 1, dtype=torch.int32)
    qo[-1] += 2  # the last row verifies 2 draft tokens: 3 queries
    q = torch.cat((q, torch.randn(2, hq, dim, generator=g).to(torch.bfloat16)))

    def both() -> dict[str, torch.Tensor]:
        return {"fp8": op(q, k8, v8, indptr, indices, 0.125, qo),
                "bf16": op(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), indptr, indices, 0.125, qo)}

    for arithmetic, outs in in_each_bf16_arithmetic(both).items():
        assert torch.isfinite(outs["fp8"]).all(), arithmetic
        assert torch.equal(outs["fp8"], outs["bf16"]), arithmetic


def test_kernel_rejects_bad_metadata(op):
    q, k_cache, v_cache, indptr, indices = random_paged_inputs(0, [3, 4], 4, 2, 16, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="outside"):
        op(q, k_cache, v_cache, indptr, torch.tensor([1, 2, 3, 4, 5, 6, k_cache.shape[0]]), 0.25)
    with pytest.raises(RuntimeError, match="fewer KV slots than queries"):
        op(q, k_cache, v_cache, torch.tensor([0, 0, 7], dtype=torch.int32), indices, 0.25)
    with pytest.raises(RuntimeError, match="multiple of (8|16)"):  # the vector width: 16 lanes on AVX-512, else 8
        op(q[..., :12].contiguous(), k_cache[..., :12].contiguous(), v_cache[..., :12].contiguous(), indptr, indices, 0.25)


# Verification rows (queries, context length): one query; queries straddling the 256-token chunk boundary
# (their contexts end on both sides of it) and the 512 one; more queries than one work item takes (32 query
# vectors: tiles); a row whose every slot is one of its queries; short and long contexts.
VERIFY_ROWS = [(1, 40), (9, 262), (13, 520), (20, 300), (5, 5), (3, 31), (9, 1000), (2, 257)]


def verification_inputs(seed: int, rows: list[tuple[int, int]], hq: int, hkv: int, dim: int, dtype: torch.dtype,
                        kv_dtype: torch.dtype):
    """Rows of several queries over a random pool, and the same queries as decode rows of their own (query j
    of n over a context of L slots sees the first L - (n - 1 - j))."""
    q, k_cache, v_cache, kv_indptr, indices = random_paged_inputs(seed, [length for _, length in rows], hq, hkv, dim, dtype, kv_dtype)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(n for n, _ in rows), hq, dim, generator=g).to(dtype)
    qo_indptr = torch.tensor([0, *torch.tensor([n for n, _ in rows]).cumsum(0).tolist()], dtype=torch.int32)
    alone = []
    for (n, length), start in zip(rows, kv_indptr.tolist()):
        alone += [indices[start : start + length - (n - 1 - j)] for j in range(n)]
    alone_indptr = torch.tensor([0, *torch.tensor([len(a) for a in alone]).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, (kv_indptr, indices, qo_indptr), (alone_indptr, torch.cat(alone))


@pytest.mark.parametrize("arithmetic", ["fma", "dpbf16"])
@pytest.mark.parametrize("kv", ["same", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 128), (4, 4, 32)], ids=["gqa3", "mqa8", "mha"])
def test_verification_rows_give_each_query_the_bits_of_decoding_it_alone(op, heads, dtype, kv, arithmetic):
    """A verification row's queries share its reads of K/V; each must still sum what it sees in the order
    a decode row of its own does, so that speculation cannot change a greedy token."""
    if dtype == torch.float32 and arithmetic == "dpbf16":
        pytest.skip("the pairs arithmetic is for bf16 queries and K/V")
    hq, hkv, dim = heads
    q, k_cache, v_cache, rows, alone = verification_inputs(hq + dim, VERIFY_ROWS, hq, hkv, dim, dtype, dtype if kv == "same" else FP8[kv])
    with loader.bf16_arithmetic(arithmetic):
        together = op(q, k_cache, v_cache, rows[0], rows[1], dim**-0.5, rows[2])
        expected = op(q, k_cache, v_cache, alone[0], alone[1], dim**-0.5)
        # one row at a time too: the batch (which picks the work items' shape) must not matter either
        first = op(q[:1], k_cache, v_cache, rows[0][:2], rows[1], dim**-0.5, rows[2][:2])
    assert torch.equal(together, expected)
    assert torch.equal(first, expected[:1])
    reference_rows = reference(q, k_cache, v_cache, alone[0], alone[1], dim**-0.5)
    assert (together.double() - reference_rows).abs().max() < TOLERANCE[dtype]


def test_kernel_rejects_bad_verification_rows(op):
    q, k_cache, v_cache, rows, _ = verification_inputs(0, [(3, 10), (2, 4)], 4, 2, 16, torch.float32, torch.float32)
    kv_indptr, indices, qo_indptr = rows
    op(q, k_cache, v_cache, kv_indptr, indices, 0.25, qo_indptr)
    with pytest.raises(RuntimeError, match="from 0 to the number of q rows"):
        op(q, k_cache, v_cache, kv_indptr, indices, 0.25, torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="has no queries"):
        op(q, k_cache, v_cache, torch.tensor([0, 0, 14], dtype=torch.int32), indices, 0.25, torch.tensor([0, 0, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="fewer KV slots than queries"):
        op(q, k_cache, v_cache, torch.tensor([0, 2, 14], dtype=torch.int32), indices, 0.25, qo_indptr)
    with pytest.raises(RuntimeError, match="one entry per row"):
        op(q, k_cache, v_cache, kv_indptr, indices, 0.25, torch.tensor([0, 5], dtype=torch.int32))


def shared_prefix_inputs(seed: int, hq: int, hkv: int, dim: int, dtype: torch.dtype, kv_dtype: torch.dtype):
    """Rows over one pool, most of them holding the same slots for a prompt of 600 tokens (two whole 256-token
    chunks and part of a third) and tails of their own: more sharers than one work item takes for any group
    size here (34), some of them verification rows of 3 or 9 queries (whose first query may end before a
    shared chunk does), a row sharing only the first chunk, a row whose first chunk has the same first and
    last slots but another in the middle, a row of exactly one chunk, rows too short for a whole one, and
    a verification row whose first queries see part of a chunk the others share.
    Returns q, the pool, (kv_indptr, kv_indices, qo_indptr) and each query as a decode row of its own."""
    g = torch.Generator().manual_seed(seed)
    num_slots = 40000
    k_cache = (torch.randn(num_slots, hkv, dim, generator=g) * 2).to(kv_dtype)
    v_cache = torch.randn(num_slots, hkv, dim, generator=g).to(kv_dtype)
    free = iter(torch.randperm(num_slots, generator=g).tolist())
    take = lambda n: [next(free) for _ in range(n)]  # noqa: E731
    prompt = take(600)
    contexts = [prompt + take(tail) for tail in [1, 40, 300, 0, 7, 511, 2] * 5]
    queries = [1, 3, 1, 9, 1, 1, 1] * 5  # the 9-query row with no tail: its first query ends at 592
    contexts.append(prompt[:256] + take(100))
    middle = list(prompt[:256])
    middle[100] = next(free)
    contexts += [middle + take(30), prompt[:256], take(200), prompt[:100], prompt[:516]]
    queries += [1, 1, 1, 1, 1, 9]  # the last: its first query sees 4 of the second chunk's slots fewer
    indices = torch.tensor([s for row in contexts for s in row], dtype=torch.int64)
    kv_indptr = torch.tensor([0, *torch.tensor([len(r) for r in contexts]).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(queries), hq, dim, generator=g).to(dtype)
    alone = [row[: len(row) - (n - 1 - j)] for row, n in zip(contexts, queries) for j in range(n)]
    alone_indptr = torch.tensor([0, *torch.tensor([len(a) for a in alone]).cumsum(0).tolist()], dtype=torch.int32)
    alone_indices = torch.tensor([s for row in alone for s in row], dtype=torch.int64)
    return q, k_cache, v_cache, (kv_indptr, indices, qo_indptr), (alone_indptr, alone_indices)


@pytest.mark.parametrize("arithmetic", ["fma", "dpbf16"])
@pytest.mark.parametrize("kv", ["same", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 128), (4, 4, 32)], ids=["gqa3", "mqa8", "mha"])
def test_rows_sharing_a_prompt_get_the_bits_of_decoding_alone(op, heads, dtype, kv, arithmetic):
    """Rows holding the same slots over a whole chunk are attended together (each K/V row read once for all
    their queries); each query must still get the bits it gets decoded alone, within a rounding of float64."""
    if dtype == torch.float32 and arithmetic == "dpbf16":
        pytest.skip("the pairs arithmetic is for bf16 queries and K/V")
    hq, hkv, dim = heads
    q, k_cache, v_cache, rows, alone = shared_prefix_inputs(dim, hq, hkv, dim, dtype, dtype if kv == "same" else FP8[kv])
    scale = dim**-0.5
    with loader.bf16_arithmetic(arithmetic):
        together = op(q, k_cache, v_cache, rows[0], rows[1], scale, rows[2])
        decoded = op(q, k_cache, v_cache, alone[0], alone[1], scale)
        one_by_one = [op(q[i : i + 1], k_cache, v_cache, alone[0][i : i + 2] - alone[0][i], alone[1][alone[0][i] : alone[0][i + 1]], scale)
                      for i in range(q.shape[0])]
    for i, out in enumerate(one_by_one):
        assert torch.equal(together[i : i + 1], out), f"query {i}"
        assert torch.equal(decoded[i : i + 1], out), f"query {i} as a decode row"
    assert (together.double() - reference(q, k_cache, v_cache, alone[0], alone[1], scale)).abs().max() < TOLERANCE[dtype]


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("case", ["decode_only", "mixed", "verify"])
def test_backend_matches_naive_on_mixed_batches(op, case, kv):
    """Through the backend: KV writes (fp8 pools round and saturate), decode rows through the kernel in any
    batch position, extend rows through SDPA; against a float64 naive reference over the stored pool."""
    # Extend rows have a prefix: without one, SDPA reads the new rows before rounding, as SGLang's ragged prefill.
    # "verify": speculative verification rows (extend over a prefix, meta.verify_rows), one kernel query per token.
    prefix_lens, extend_lens = {"decode_only": ([5, 120, 1, 40], [1, 1, 1, 1]),
                                "mixed": ([33, 4, 5, 12, 2, 70], [1, 7, 1, 4, 1, 1]),
                                "verify": ([33, 4, 5, 12, 2, 70], [1, 7, 1, 4, 1, 3])}[case]
    verify = [1, 5] if case == "verify" else None
    pool, meta, q, k, v = random_batch(3, prefix_lens, extend_lens, 9, 3, d=32, verify_rows=verify)
    if kv != "auto":
        fp8 = KVPool(2, pool.num_slots, 3, 32, kv_cache_dtype(kv, torch.float32))
        for layer in range(2):
            fp8.write(layer, torch.arange(1, pool.num_slots + 1), pool.k[layer][1:].nan_to_num(), pool.v[layer][1:].nan_to_num())
        pool = fp8
    backend = CpuKernelBackend(9, 3, 32, op)
    backend.prepare(meta)
    assert len(backend._extends) == sum(e > 1 for e in extend_lens) - len(verify or [])
    for layer in range(2):
        out = backend.forward(layer, q, k * 300, v, pool)  # k * 300: beyond e4m3's range, the pool saturates
        stored = KVPool(2, pool.num_slots, 3, 32, torch.float32)
        stored.k = [c.float() for c in pool.k]
        stored.v = [c.float() for c in pool.v]
        assert torch.isfinite(stored.k[layer][meta.out_cache_loc]).all()
        # scores reach ~1e4 here: fp32 rounding of the logits, not of the outputs, sets the tolerance
        assert (out - naive_attention(meta, layer, q, stored)).abs().max() < 1e-4


def test_torch_path_reads_fp8_pool():
    """The torch reference backend converts 8-bit pools after its gather: same result as on the dequantized pool."""
    pool, meta, q, k, v = random_batch(5, [20, 3, 2], [1, 1, 4], 4, 2, d=16)
    fp8 = KVPool(2, pool.num_slots, 2, 16, torch.float8_e4m3fn)
    for layer in range(2):
        fp8.write(layer, torch.arange(1, pool.num_slots + 1), pool.k[layer][1:].nan_to_num(), pool.v[layer][1:].nan_to_num())
    backend = TorchNativeBackend(4, 2, 16)
    backend.prepare(meta)
    out = backend.forward(0, q, k, v, fp8)
    stored = KVPool(2, pool.num_slots, 2, 16, torch.float32)
    stored.k, stored.v = [c.float() for c in fp8.k], [c.float() for c in fp8.v]
    assert (out - naive_attention(meta, 0, q, stored)).abs().max() < 1e-5


def test_auto_picks_the_kernel_on_cpu_and_falls_back(op, monkeypatch, caplog):
    assert isinstance(create_backend("auto", torch.device("cpu"), 9, 3, 64), CpuKernelBackend)
    # a head layout the kernel does not take: torch path, one log line
    with caplog.at_level(logging.WARNING):
        assert type(create_backend("cpu_kernel", torch.device("cpu"), 4, 2, 24)) is TorchNativeBackend
    assert "does not support" in caplog.text


def test_kv_cache_dtype_flag():
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="int4")
    assert KVPool.bytes_per_slot(2, 3, 64, torch.float8_e4m3fn) * 2 == KVPool.bytes_per_slot(2, 3, 64, torch.bfloat16)


def extend_kernel():
    from sgl_lite.runtime.layers.attention.cpu_kernel import extend_kernel_available

    if not extend_kernel_available():
        pytest.skip("the extend kernel needs AVX-512")


@pytest.fixture(params=["fma", "dpbf16"])
def bf16_arithmetic(request):
    """The bf16 extend kernel in float32 FMAs or in VDPBF16PS pairs: it follows bf16_gemv's probe, which
    this sets for a test (either runs on any AVX512-BF16 CPU), then gives the probe back its choice."""
    extend_kernel()
    if torch.ops.sgl_lite.bf16_gemv_arithmetic() == "none":
        pytest.skip("no AVX512-BF16 on this CPU")
    with loader.bf16_arithmetic(request.param):
        yield request.param


def in_each_bf16_arithmetic(compute: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """compute() with the bf16 kernels in float32 FMAs and in VDPBF16PS pairs (bf16_gemv's probe overridden,
    then given back its choice); skips the test on CPUs without AVX512-BF16."""
    if torch.ops.sgl_lite.bf16_gemv_arithmetic() == "none":
        pytest.skip("no AVX512-BF16 on this CPU")
    outs: dict[str, torch.Tensor] = {}
    for arithmetic in ("fma", "dpbf16"):
        with loader.bf16_arithmetic(arithmetic):
            outs[arithmetic] = compute()
    return outs


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_bf16_decode_kernel_matches_reference_in_each_arithmetic(op, shape, bf16_arithmetic):
    """The decode kernel in both bf16 arithmetics (float32 FMAs, or VDPBF16PS pairs: csrc/attention/decode_pairs.h)
    within one bf16 rounding of the float64 reference, and each request's output the same bits alone as in
    its batch."""
    lens, hq, hkv, dim = SHAPES[shape]
    q, k_cache, v_cache, indptr, indices = random_paged_inputs(len(shape), lens, hq, hkv, dim, torch.bfloat16, torch.bfloat16)
    out = op(q, k_cache, v_cache, indptr, indices, dim**-0.5)
    expected = reference(q, k_cache, v_cache, indptr, indices, dim**-0.5)
    assert (out.double() - expected).abs().max() < TOLERANCE[torch.bfloat16]
    for b in range(len(lens)):
        own = indices[indptr[b] : indptr[b + 1]]
        alone = op(q[b : b + 1], k_cache, v_cache, torch.tensor([0, len(own)], dtype=torch.int32), own, dim**-0.5)
        assert torch.equal(alone[0], out[b])


def test_bf16_decode_arithmetics_differ_where_pairs_apply(op):
    """The switch reaches the decode kernel: at head size 64 (GQA 3) and 128 (GQA 4) the pairs path sums in
    another order, so some output bits differ from the FMA path's; at head size 16 both run FMAs."""
    outs: dict[int, dict[str, torch.Tensor]] = {}
    for hq, hkv, dim in ((9, 3, 64), (8, 2, 128), (8, 1, 16)):
        inputs = random_paged_inputs(5, [40, 300, 2000, 700, 1000, 5, 1500, 90], hq, hkv, dim, torch.bfloat16, torch.bfloat16)
        outs[dim] = in_each_bf16_arithmetic(partial(op, *inputs, dim**-0.5))
    assert not torch.equal(outs[64]["fma"], outs[64]["dpbf16"])
    assert not torch.equal(outs[128]["fma"], outs[128]["dpbf16"])
    assert torch.equal(outs[16]["fma"], outs[16]["dpbf16"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_work_item_runs_once_whatever_the_thread_count(op, dtype):
    """Threads claim their next work item ahead, while the current one's prefetch look-ahead runs into it:
    with 1-3 threads over many items of every size (shorter than the look-ahead, one chunk and a token more,
    several chunks), every row gets the same bits, within a rounding of the float64 reference."""
    lens = [1, 5, 95, 96, 97, 255, 256, 257, 600, 3, 1300, 40] * 3
    q, k_cache, v_cache, indptr, indices = random_paged_inputs(11, lens, 9, 3, 64, dtype, dtype)
    expected = reference(q, k_cache, v_cache, indptr, indices, 0.125)
    threads = torch.get_num_threads()
    outs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outs.append(op(q, k_cache, v_cache, indptr, indices, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert (outs[0].double() - expected).abs().max() < TOLERANCE[dtype]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
