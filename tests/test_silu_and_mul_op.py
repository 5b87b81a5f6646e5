"""The C++ silu_and_mul op (kernels/csrc/layer/silu_and_mul.cpp) against torch's two ops, silu(gate) * up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl_lite.runtime.kernels import loader
from sgl_lite.runtime.layers.activation import silu_and_mul


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert loader.load_cpu_ops(), "the C++ CPU ops did not build on this machine"


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit for bit, except that a NaN may carry another payload (both are NaN)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    assert torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


@pytest.mark.parametrize("up", [1.0, -3.0, 0.37, 1e-38, 3e38, float("inf"), float("nan")])
def test_every_bf16_gate_value_gives_torchs_bits(up: float) -> None:
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # every bf16 value, NaNs and infs too
    gate_up = torch.cat([gate, torch.full_like(gate, up)]).view(1, -1).repeat(3, 1)
    assert_same_bits(torch.ops.sgl_lite.silu_and_mul(gate_up), torch_silu_and_mul(gate_up))


@pytest.mark.parametrize("inter", [1, 7, 16, 23, 1536])  # rows' tails shorter than a vector, and none
@pytest.mark.parametrize("rows", [0, 1, 8, 97])  # none, one thread, and a prefill's rows across threads
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
def test_random_rows_give_torchs_bits(rows: int, inter: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    out = silu_and_mul(gate_up)
    assert out.shape == (rows, inter) and out.is_contiguous()
    assert_same_bits(out, torch_silu_and_mul(gate_up))


def test_a_strided_input_is_read_as_its_values() -> None:
    gate_up = torch.randn(6, 64).bfloat16()[::2]  # every other row: not contiguous
    assert_same_bits(torch.ops.sgl_lite.silu_and_mul(gate_up), torch_silu_and_mul(gate_up))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(RuntimeError, match="gate_up must be"):
        torch.ops.sgl_lite.silu_and_mul(torch.randn(2, 7).bfloat16())
    with pytest.raises(RuntimeError, match="gate_up must be"):
        torch.ops.sgl_lite.silu_and_mul(torch.randn(8).bfloat16())
