"""The small-row matmuls (kernels/csrc/matmul/bf16_gemv.cpp, avx2_gemv.cpp) against float64 reference matmuls, and
where the model uses them. Each test runs for the dtypes a kernel serves on this CPU: bf16 on AVX512-BF16
(bf16_gemv) or AVX2 (avx2_gemv), float32 on AVX2 (avx2_gemv)."""

from __future__ import annotations

import pytest
import torch

from sgl_lite.runtime.layers.linear import GemvLinear, gemv_kernel, gemv_max_rows, gemv_supported, linear

DTYPES = [
    pytest.param(dtype, id=name, marks=pytest.mark.skipif(
        not gemv_supported(torch.empty(16, 2, dtype=dtype)), reason=f"no small-row kernel for {name} on this CPU"))
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
]


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def tolerance(expected: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        # fp32 sums of exact bf16 products, then one rounding to bf16: within a bf16 ulp of the exact
        # result (plus float summation-order noise)
        return expected.abs() * 2**-8 + 1e-4 * k**0.5
    return expected.abs() * 1e-6 + 1e-6 * k**0.5  # fp32 FMAs in order: summation noise only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 12, 13, 16, 17, 25, 32, 200])
@pytest.mark.parametrize("shape", [(16, 2), (48, 64), (960, 576), (576, 1536), (80, 30)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(dtype: torch.dtype, rows: int, shape: tuple[int, int], with_bias: bool) -> None:
    torch.manual_seed(rows * 1000 + shape[0])
    n, k = shape
    weight = (torch.randn(n, k) / k**0.5).to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    x = torch.randn(rows, k).to(dtype)
    out = linear(x, weight, bias, GemvLinear.pack(weight, None))
    expected = reference(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert ((out.double() - expected).abs() <= tolerance(expected, k, dtype)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_the_others_or_the_threads(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    weight = torch.randn(3072, 576).to(dtype)
    form = GemvLinear.pack(weight, None)
    assert form.takes(128)
    x = torch.randn(128, 576).to(dtype)
    batched = linear(x, weight, None, form)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [linear(x[i : i + 1], weight, None, form) for i in range(x.shape[0])]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(alone), batched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_rows_than_the_kernel_takes_use_the_dense_form(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    weight = torch.randn(64, 32).to(dtype)
    form = GemvLinear.pack(weight, None)
    limit = gemv_max_rows(gemv_kernel(weight))
    if limit is None:
        pytest.skip("the kernel takes every call here (an AVX2-only CPU)")
    x = torch.randn(limit + 1, 32).to(dtype)
    assert torch.equal(linear(x, weight, None, form), torch.nn.functional.linear(x, weight))


def test_an_avx2_only_cpu_runs_every_call_through_the_kernel() -> None:
    """Where MKL's sgemm is AVX2 too and torch has no fast bf16 matmul, the kernel wins at every row count
    (layers/linear.py), prefill included."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        pytest.skip("this CPU is not AVX2-only")
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(16, 8).to(dtype)
        assert gemv_kernel(weight) == "avx2"
        assert GemvLinear.pack(weight, None).takes(100_000)


def test_unsupported_shapes_and_dtypes_are_refused() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        assert not gemv_supported(torch.empty(24, 8, dtype=dtype))  # columns not a multiple of 16
    assert gemv_kernel(torch.empty(16, 7, dtype=torch.bfloat16)) != "avx512_bf16"  # it packs pairs along K
    assert not gemv_supported(torch.empty(16, 8, dtype=torch.float16))
    if gemv_kernel(torch.empty(16, 2, dtype=torch.bfloat16)) == "avx512_bf16":
        with pytest.raises(RuntimeError, match="packed weight must be"):
            torch.ops.sgl_lite.bf16_gemv(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 3, 16, 2, dtype=torch.bfloat16), None)
        with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
            torch.ops.sgl_lite.bf16_gemv(torch.zeros(1, 8), torch.zeros(1, 4, 16, 2, dtype=torch.bfloat16), None)
    else:
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            torch.ops.sgl_lite.bf16_gemv(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 1, 16, 2, dtype=torch.bfloat16), None)
    if not torch.ops.sgl_lite.avx2_gemv_supported():
        return
    with pytest.raises(RuntimeError, match="packed weight must be"):
        torch.ops.sgl_lite.avx2_gemv(torch.zeros(1, 8), torch.zeros(1, 7, 16), None)
    with pytest.raises(RuntimeError, match="packed weight must be"):  # weights of another dtype than x
        torch.ops.sgl_lite.avx2_gemv(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 8, 16), None)
    with pytest.raises(RuntimeError, match="x must be contiguous float32 or bf16"):
        torch.ops.sgl_lite.avx2_gemv(torch.zeros(1, 8, dtype=torch.float16), torch.zeros(1, 8, 16), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.sgl_lite.avx2_gemv(torch.zeros(1, 8), torch.zeros(1, 8, 16), torch.zeros(3))
    with pytest.raises(ValueError, match="no small-row kernel"):
        GemvLinear.pack(torch.zeros(24, 8), None)


@pytest.fixture
def bf16_arithmetic():
    """Sets the AVX512-BF16 kernel's arithmetic for a test, then gives the probe back its choice."""
    if gemv_kernel(torch.empty(16, 2, dtype=torch.bfloat16)) != "avx512_bf16":
        pytest.skip("no AVX512-BF16 kernel on this CPU")
    ops = torch.ops.sgl_lite
    chosen = ops.bf16_gemv_arithmetic()
    yield ops.set_bf16_gemv_arithmetic
    ops.set_bf16_gemv_arithmetic(chosen)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 12, 13, 17, 25, 40, 129])
@pytest.mark.parametrize("shape", [(16, 2), (48, 64), (960, 576), (80, 30)])
def test_fma_arithmetic_gives_the_bits_of_vdpbf16ps(bf16_arithmetic, rows: int, shape: tuple[int, int]) -> None:
    """Two FMAs per pair (odd half first) under DAZ/FTZ are VDPBF16PS, so the probe may pick either."""
    torch.manual_seed(rows + shape[0])
    n, k = shape
    weight = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    weight[0, :2] = torch.tensor([1e-39, -3e-39])  # subnormal weights and products: read as zero by both
    bias = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    x[0, 1] = 2e-39
    packed = GemvLinear.pack(weight, None).gemv_weight
    outs = {}
    for arithmetic in ("dpbf16", "fma"):
        bf16_arithmetic(arithmetic)
        assert torch.ops.sgl_lite.bf16_gemv_arithmetic() == arithmetic
        outs[arithmetic] = torch.ops.sgl_lite.bf16_gemv(x, packed, bias)
    assert torch.equal(outs["dpbf16"], outs["fma"])
    assert ((outs["fma"].double() - reference(x, weight, bias)).abs() <= tolerance(reference(x, weight, bias), k, torch.bfloat16)).all()


def test_the_arithmetic_can_only_be_set_to_a_known_one(bf16_arithmetic) -> None:
    with pytest.raises(RuntimeError, match="arithmetic must be auto, dpbf16 or fma"):
        bf16_arithmetic("amx")
    bf16_arithmetic("auto")  # probes again on the next call
    assert torch.ops.sgl_lite.bf16_gemv_arithmetic() in ("dpbf16", "fma")
