"""The paths a CPU with AMX takes (layers/onednn.amx_matmuls): torch's SDPA for long extends, oneDNN's bf16
matmuls for a prefill forward's calls above a few rows, oneDNN's int8 matmul for w8a8 calls of many rows.
Each is checked against a reference on any CPU where it can run, and through the dispatch where AMX is here."""

from __future__ import annotations

import pytest
import torch
from test_attention import naive_attention, random_batch

from sgl_lite.runtime.kernels import loader, ops
from sgl_lite.runtime.layers import linear as linear_module
from sgl_lite.runtime.layers.attention import amx_extend
from sgl_lite.runtime.layers.attention.cpu_kernel import CpuKernelBackend
from sgl_lite.runtime.layers.attention.torch_native import ExtendReq
from sgl_lite.runtime.layers.linear import AMX_PREFILL_GEMV_MAX_ROWS, GEMV_MAX_ROWS, GemvLinear, gemv_supported, linear
from sgl_lite.runtime.layers.onednn import amx_matmuls
from sgl_lite.runtime.layers.quantization import w8a8
from sgl_lite.runtime.mem_cache.memory_pool import KVPool, kv_cache_dtype

# extends of both kinds (with and without a prefix), GQA, a decode row beside them
PREFIX_LENS, EXTEND_LENS = [0, 150, 7, 40], [70, 90, 1, 64]


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_sdpa_extend_matches_a_naive_reference(kv: str) -> None:
    pool, meta, q, k, v = random_batch(5, PREFIX_LENS, EXTEND_LENS, 8, 2, d=32)
    if kv != "auto":  # an 8-bit pool: the prefix is read rounded, a prompt without one attends its own rows
        fp8 = KVPool(2, pool.num_slots, 2, 32, kv_cache_dtype(kv, torch.float32))
        for layer in range(2):
            fp8.write(layer, torch.arange(1, pool.num_slots + 1), pool.k[layer][1:].nan_to_num(), pool.v[layer][1:].nan_to_num())
        pool = fp8
    qo, seq = meta.qo_indptr.tolist(), meta.seq_lens.tolist()
    for layer in range(2):
        pool.write(layer, meta.out_cache_loc, k, v)
        stored = KVPool(2, pool.num_slots, 2, 32, torch.float32)
        stored.k, stored.v = [c.float() for c in pool.k], [c.float() for c in pool.v]
        if kv != "auto":  # the first request's own rows, unrounded, are what it attends
            first = meta.padded_kv_indices[0, : EXTEND_LENS[0]]
            stored.k[layer][first], stored.v[layer][first] = k[: EXTEND_LENS[0]], v[: EXTEND_LENS[0]]
        expected = naive_attention(meta, layer, q, stored)
        out = torch.zeros_like(q)
        for i, (prefix, extend) in enumerate(zip(PREFIX_LENS, EXTEND_LENS)):
            if extend > 1:
                req = ExtendReq(start=qo[i], end=qo[i + 1], kv_slots=meta.padded_kv_indices[i, : seq[i]], prefix=prefix)
                amx_extend.attend(req, amx_extend.causal_mask(req), q, k, v, pool.k[layer], pool.v[layer], 32**-0.5, out)
                assert (out[qo[i] : qo[i + 1]] - expected[qo[i] : qo[i + 1]]).abs().max() < 1e-5, f"request {i}"


@pytest.mark.skipif(not amx_matmuls(), reason="no AMX here: the backend keeps every extend on its kernel")
def test_the_cpu_kernel_backend_sends_long_extends_of_a_float32_pool_to_sdpa_on_amx() -> None:
    """A float32 pool (no AMX kernel for it): long extends through SDPA, short ones through the extend kernel."""
    if not loader.has_op("paged_decode_attention"):
        pytest.skip("the CPU decode kernel is not built")
    pool, meta, q, k, v = random_batch(6, PREFIX_LENS, EXTEND_LENS, 8, 2, d=32)
    backend = CpuKernelBackend(8, 2, 32, torch.ops.sgl_lite.paged_decode_attention)
    backend.prepare(meta)
    for layer in range(2):
        out = backend.forward(layer, q, k, v, pool)
        assert len(backend._sdpa_extends) == 3  # the 1-token row is a decode row
        assert (out - naive_attention(meta, layer, q, pool)).abs().max() < 1e-5


def test_a_prefill_forward_takes_its_own_row_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX, a forward with prefill rows hands oneDNN every call above AMX_PREFILL_GEMV_MAX_ROWS rows,
    and a decode forward keeps the kernel's limit (its rows batch invariant); without AMX both are the same."""
    weight = torch.randn(64, 32).to(torch.bfloat16)
    if not gemv_supported(weight):
        pytest.skip("no small-row kernel here")
    for amx in (True, False):
        monkeypatch.setattr(linear_module, "amx_matmuls", lambda amx=amx: amx)
        dense = torch.ops.mkldnn._reorder_linear_weight(weight, 32) if linear_module.onednn_bf16_supported() else None
        form = GemvLinear.pack(weight, dense)
        rows = AMX_PREFILL_GEMV_MAX_ROWS + 1
        assert form.takes(rows) == (form.max_rows is None or rows <= form.max_rows)
        assert form.takes(rows, prefill=True) == (not amx and form.takes(rows))
        if form.max_rows is not None:
            assert form.max_rows == GEMV_MAX_ROWS
        if amx and dense is not None:  # the prefill call gives oneDNN's bits, the decode call the kernel's
            x = torch.randn(rows, 32).to(torch.bfloat16)
            assert torch.equal(linear(x, weight, None, form, prefill=True), torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], ""))
            assert torch.equal(linear(x, weight, None, form), GemvLinear.pack(weight, None)(x, weight, None))


@pytest.mark.skipif(not w8a8.amx_int8_rows(), reason="no AMX tiles here (or the ops are not built)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k", "rows"), [(96, 256, 49), (80, 192, 300), (88, 128, 33), (64, 4096, 300)])
def test_amx_int8_rows_give_the_kernel_bits(dtype: torch.dtype, n: int, k: int, rows: int) -> None:
    """Calls above AMX_KERNEL_MAX_ROWS on csrc/matmul/amx_w8a8_gemm.cpp: the torch reference's and the VNNI kernel's
    bits, with groups of three column blocks, a last group of two (80) or one (64: a pair of blocks across two
    groups), padded columns (88), rows not a whole unit, and two slabs of rows (K = 4,096: 256-row slabs)."""
    torch.manual_seed(3)
    weight = torch.randn(n, k).to(dtype)
    form = w8a8.W8A8Int8(weight)
    assert form.amx_rows and rows > w8a8.AMX_KERNEL_MAX_ROWS
    x = torch.randn(rows, k).to(dtype) * 4
    x[3] = 0  # an all-zero row quantizes to zeros
    bias = torch.randn(n)
    for b in (None, bias):
        many = form.matmul(x, b)  # above the kernel's rows: the AMX kernel's sums
        assert many.shape == (rows, n)
        assert torch.equal(many, form.reference_matmul(x, b))
        few = torch.cat([form.matmul(x[i : i + 8], b) for i in range(0, rows, 8)])  # the VNNI kernel's
        assert torch.equal(many, few)


@pytest.mark.skipif(not w8a8.amx_int8_rows(), reason="no AMX tiles here (or the ops are not built)")
def test_a_k_the_amx_int8_kernel_cannot_step_keeps_the_vnni_kernel() -> None:
    """K = 96 is no whole number of 64-k tile steps: the form keeps every call on the VNNI kernel (the
    reference's bits), and the op itself refuses such rows by name."""
    torch.manual_seed(4)
    form = w8a8.W8A8Int8(torch.randn(32, 96))
    assert not form.amx_rows
    x = torch.randn(40, 96)
    assert torch.equal(form.matmul(x), form.reference_matmul(x))
    q, row_scale = ops.w8a8_quantize_rows(x)
    with pytest.raises(RuntimeError, match="amx_w8a8_gemm: K must be a positive multiple of 64"):
        ops.amx_w8a8_gemm(q, row_scale, form.packed, None, torch.float32)


def test_prefill_rows_are_what_a_forward_with_a_prompt_has() -> None:
    _, meta, *_ = random_batch(7, [3, 0], [1, 5], 4, 2)
    assert meta.has_prefill_rows
    _, decode, *_ = random_batch(7, [3, 9], [1, 1], 4, 2)
    assert not decode.has_prefill_rows
    _, verify, *_ = random_batch(7, [3, 9], [1, 4], 4, 2, verify_rows=[1])
    assert not verify.has_prefill_rows
