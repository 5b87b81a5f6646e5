"""The C++ RMSNorm op (kernels/csrc/layer/rms_norm.cpp) against transformers' LlamaRMSNorm arithmetic."""

from __future__ import annotations

import pytest
import torch

from sgl_lite.runtime.kernels import loader
from sgl_lite.runtime.layers.layernorm import RMSNorm


def transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward: fp32 variance, normalize, cast back, then scale by the weight."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert loader.load_cpu_ops(), "the C++ CPU ops did not build on this machine"


@pytest.mark.parametrize("rows", [1, 8, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_matches_transformers(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 576, generator=g).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    expected_sum = x + residual
    normed = torch.ops.sgl_lite.rms_norm(x, weight, 1e-5)
    fused, total = torch.ops.sgl_lite.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, expected_sum)  # the residual stream is rounded exactly as `x + residual`
    if dtype == torch.bfloat16:  # same roundings as transformers: bit-identical
        assert torch.equal(normed, transformers_rms_norm(x, weight, 1e-5))
        assert torch.equal(fused, transformers_rms_norm(expected_sum, weight, 1e-5))
    else:  # fp32: only the order of the sum of squares differs
        torch.testing.assert_close(normed, transformers_rms_norm(x, weight, 1e-5), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(fused, transformers_rms_norm(expected_sum, weight, 1e-5), rtol=1e-6, atol=1e-5)


def test_module_with_and_without_the_op_agree() -> None:
    norm = RMSNorm(64, 1e-6, torch.bfloat16, torch.device("cpu"))
    assert norm.cpu_op
    norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x, residual = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    with_op = norm(x), norm(x, residual)
    norm.cpu_op = False
    without = norm(x), norm(x, residual)
    assert torch.equal(with_op[1][1], without[1][1])
    for a, b in ((with_op[0], without[0]), (with_op[1][0], without[1][0])):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)  # torch's rms_norm rounds once less in bf16


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.sgl_lite.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.sgl_lite.rms_norm(torch.randn(2, 8), torch.randn(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="residual must be"):
        torch.ops.sgl_lite.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5)
