"""The C++ argmax over logit rows (kernels/csrc/layer/argmax_rows.cpp) answers as torch.argmax(x, -1) does."""

from __future__ import annotations

import pytest
import torch

from sgl_lite.runtime.kernels.loader import load_cpu_ops
from sgl_lite.runtime.sampling.sampler import argmax_ids


@pytest.fixture(scope="module")
def op():
    assert load_cpu_ops(), "the CPU ops did not build on this machine"
    return torch.ops.sgl_lite.argmax_rows


@pytest.mark.parametrize("width", [1, 5, 15, 16, 17, 31, 48, 100, 49152])
def test_matches_torch_on_random_rows_with_ties(op, width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(33, width, generator=g)
    x[1] = 0.0  # all equal: the first index
    x[2, : width // 2] = x[2].max() + 1  # a run of equal maxima: the first of them
    x[3] = -float("inf")
    x[4, -1] = float("inf")
    x[5] = torch.randint(0, 3, (width,), generator=g).float()  # many ties
    x[6] = -0.0
    x[6, -1] = 0.0  # -0 == +0: still the first index
    assert torch.equal(op(x), x.argmax(-1))


@pytest.mark.parametrize("position", [0, 7, 16, 40, 49151])
def test_nan_counts_as_the_largest(op, position):
    x = torch.randn(3, 49152, generator=torch.Generator().manual_seed(position))
    x[1, position] = float("nan")
    x[2, position] = float("nan")
    x[2, 49151] = float("nan")
    assert torch.equal(op(x), x.argmax(-1))


def test_sampler_helper_falls_back_to_torch_elsewhere(op):
    x = torch.randn(4, 40)
    assert torch.equal(argmax_ids(x), x.argmax(-1))
    assert torch.equal(argmax_ids(x.bfloat16()), x.bfloat16().argmax(-1))  # not float32: torch's
    assert torch.equal(argmax_ids(x.t().contiguous().t()), x.argmax(-1))  # strided: made contiguous
    assert argmax_ids(torch.empty(0, 40)).shape == (0,)


def test_rejects_what_it_cannot_read(op):
    with pytest.raises(RuntimeError, match="contiguous float32"):
        op(torch.randn(3, 8).double())
    with pytest.raises(RuntimeError, match="must not be empty"):
        op(torch.empty(3, 0))
