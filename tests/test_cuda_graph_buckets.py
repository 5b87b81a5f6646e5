"""What the CUDA graph runner decides without a GPU: the batch-size buckets it captures, the bucket a batch
replays, and the padding rows it appends (which must leave the real rows' attention unchanged and touch only
padding slot 0). The capture and replay themselves run in tests/test_cuda.py on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_attention import random_batch

from sgl_lite.runtime.layers.attention import TorchNativeBackend
from sgl_lite.runtime.model_executor.cuda_graph_runner import bucket_for, capture_sizes, padded_decode_metadata
from sgl_lite.runtime.server_args import ServerArgs


def test_capture_sizes_are_sglang_buckets_up_to_the_maximum() -> None:
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        capture_sizes(0)


def test_a_batch_replays_the_smallest_bucket_that_holds_it() -> None:
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 16, 24, 64, 64]
    assert bucket_for(65, sizes) is None


@pytest.mark.parametrize("pad_to", [5, 8])
def test_padding_rows_leave_the_real_rows_unchanged_and_use_slot_zero(pad_to: int) -> None:
    prefix_lens = [7, 30, 2]
    pool, meta, q, k, v = random_batch(3, prefix_lens, [1, 1, 1], 6, 2)
    padded = padded_decode_metadata(meta, pad_to)
    pad = pad_to - meta.batch_size
    assert padded.batch_size == pad_to and padded.is_decode
    assert padded.out_cache_loc[3:].tolist() == [0] * pad
    assert padded.kv_indices[meta.kv_indices.numel():].tolist() == [0] * pad
    assert torch.diff(padded.kv_indptr).tolist() == [8, 31, 3] + [1] * pad
    assert torch.equal(padded.padded_kv_indices[:3], meta.padded_kv_indices)
    qp, kp, vp = (torch.cat([t, torch.randn(pad, *t.shape[1:])]) for t in (q, k, v))

    expected, got = TorchNativeBackend(6, 2, 16), TorchNativeBackend(6, 2, 16)
    expected.prepare(meta)
    want = expected.forward(0, q, k, v, pool)
    real_slots = meta.out_cache_loc.clone()
    got.prepare(padded)
    out = got.forward(0, qp, kp, vp, pool)
    assert torch.allclose(out[:3], want, atol=1e-6)
    assert torch.isfinite(out).all()
    assert torch.equal(pool.k[0][real_slots], k)  # the real rows' K landed in their own slots


def test_padding_refuses_what_it_cannot_pad() -> None:
    _, meta, *_ = random_batch(4, [3, 4], [1, 1], 4, 2)
    with pytest.raises(ValueError, match="cannot pad"):
        padded_decode_metadata(meta, 1)
    _, prefill, *_ = random_batch(4, [0], [5], 4, 2)
    with pytest.raises(ValueError, match="cannot pad"):
        padded_decode_metadata(prefill, 4)
    assert padded_decode_metadata(meta, 2) is meta


def test_cuda_graph_flags() -> None:
    assert not ServerArgs().disable_cuda_graph and ServerArgs().cuda_graph_max_bs is None
    assert ServerArgs(cuda_graph_max_bs=32, disable_cuda_graph=True).cuda_graph_max_bs == 32
    with pytest.raises(ValueError, match="--cuda-graph-max-bs must be positive"):
        ServerArgs(cuda_graph_max_bs=0)
