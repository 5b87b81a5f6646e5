"""The small-row bf16 matmul (layers/csrc/bf16_gemv.cpp) against float32 reference matmuls, and where the model uses it."""

from __future__ import annotations

import pytest
import torch

from sgl_lite.runtime.layers.linear import GEMV_MAX_ROWS, GemvLinear, bf16_gemv_supported, linear

pytestmark = pytest.mark.skipif(
    not bf16_gemv_supported(torch.empty(16, 2, dtype=torch.bfloat16)), reason="no AVX512-BF16 build of the CPU ops here"
)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("shape", [(16, 2), (48, 64), (960, 576), (576, 1536), (80, 30)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_reference(rows: int, shape: tuple[int, int], with_bias: bool) -> None:
    torch.manual_seed(rows * 1000 + shape[0])
    n, k = shape
    weight = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k).to(torch.bfloat16)
    out = linear(x, weight, bias, GemvLinear.pack(weight, None))
    expected = reference(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # fp32 sums of exact bf16 products, then one rounding to bf16: within a bf16 ulp of the float result
    # (plus float summation-order noise)
    tolerance = expected.abs() * 2**-8 + 1e-4 * k**0.5
    assert ((out.float() - expected).abs() <= tolerance).all()


def test_a_row_does_not_depend_on_the_others_or_the_threads() -> None:
    torch.manual_seed(1)
    weight = torch.randn(3072, 576).to(torch.bfloat16)
    form = GemvLinear.pack(weight, None)
    x = torch.randn(GEMV_MAX_ROWS, 576).to(torch.bfloat16)
    batched = linear(x, weight, None, form)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [linear(x[i : i + 1], weight, None, form) for i in range(x.shape[0])]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(alone), batched)


def test_more_rows_than_the_kernel_takes_use_the_dense_form() -> None:
    torch.manual_seed(2)
    weight = torch.randn(64, 32).to(torch.bfloat16)
    form = GemvLinear.pack(weight, None)
    x = torch.randn(GEMV_MAX_ROWS + 1, 32).to(torch.bfloat16)
    assert torch.equal(linear(x, weight, None, form), torch.nn.functional.linear(x, weight))


def test_unsupported_shapes_and_dtypes_are_refused() -> None:
    assert not bf16_gemv_supported(torch.empty(24, 8, dtype=torch.bfloat16))  # columns not a multiple of 16
    assert not bf16_gemv_supported(torch.empty(16, 7, dtype=torch.bfloat16))  # odd reduction length
    assert not bf16_gemv_supported(torch.empty(16, 8, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="packed weight must be"):
        torch.ops.sgl_lite.bf16_gemv(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 3, 16, 2, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        torch.ops.sgl_lite.bf16_gemv(torch.zeros(1, 8), torch.zeros(1, 4, 16, 2, dtype=torch.bfloat16), None)
