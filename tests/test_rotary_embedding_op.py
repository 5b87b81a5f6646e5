"""The C++ rotary_embedding op (kernels/csrc/layer/rotary_embedding.cpp) against torch's rotate-half expression."""

from __future__ import annotations

import pytest
import torch
from test_silu_and_mul_op import assert_same_bits

from sgl_lite.runtime.kernels import loader
from sgl_lite.runtime.layers.rotary_embedding import apply_rope


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert loader.load_cpu_ops(), "the C++ CPU ops did not build on this machine"


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qk_of_qkv(rows: int, q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """q and k heads as the model takes them: a view of the qkv matmul's output, rows strided past v."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, (q_heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    return qkv[:, : (q_heads + kv_heads) * dim].view(rows, q_heads + kv_heads, dim)


def cos_sin(rows: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(rows, dtype=torch.float32) * 37 + 5  # far apart: many angles
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows", [0, 1, 8, 97])  # none, the calling thread alone, and rows across threads
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 128), (3, 1, 6)], ids=["smollm2", "mha-128", "tiny"])
def test_qk_heads_get_torchs_bits(dtype: torch.dtype, rows: int, heads: tuple[int, int, int]) -> None:
    q_heads, kv_heads, dim = heads
    qk = qk_of_qkv(rows, q_heads, kv_heads, dim, dtype, seed=rows * 7 + dim)
    cos, sin = cos_sin(rows, dim, dtype)
    out = torch.ops.sgl_lite.rotary_embedding(qk, cos, sin)
    assert out.is_contiguous()
    assert_same_bits(out, torch_rope(qk, cos, sin))
    assert_same_bits(apply_rope(qk, cos, sin), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_special_values_round_as_torch_does(dtype: torch.dtype) -> None:
    values = torch.tensor([0.0, -0.0, 1e-38, -3e38, 3e38, float("inf"), float("-inf"), float("nan"), 1.0 / 3, 65504.0])
    x = values[torch.randperm(len(values) * 32, generator=torch.Generator().manual_seed(0)) % len(values)].view(5, 4, 16).to(dtype)
    cos, sin = cos_sin(5, 16, dtype)
    cos[0, 0, :4] = torch.tensor([0.0, float("inf"), float("nan"), -1.0])
    assert_same_bits(torch.ops.sgl_lite.rotary_embedding(x, cos, sin), torch_rope(x, cos, sin))


def test_layouts_the_op_cannot_read_take_torchs_path() -> None:
    qk = qk_of_qkv(4, 2, 1, 8, torch.bfloat16, seed=1)
    cos, sin = cos_sin(4, 8, torch.bfloat16)
    transposed = qk.transpose(0, 1).contiguous().transpose(0, 1)  # heads no longer contiguous within a row
    assert_same_bits(apply_rope(transposed, cos, sin), torch_rope(qk, cos, sin))
    half = qk.half()
    assert torch.equal(apply_rope(half, cos.half(), sin.half()), torch_rope(half, cos.half(), sin.half()))
    with pytest.raises(RuntimeError, match="each row's heads contiguous"):
        torch.ops.sgl_lite.rotary_embedding(transposed, cos, sin)
    with pytest.raises(RuntimeError, match="cos and sin must hold"):
        torch.ops.sgl_lite.rotary_embedding(qk, cos[:3], sin[:3])
