"""kernels/csrc/attention/amx_extend_attention.cpp: extend attention on AMX tiles (bf16), against a float64 reference.

Its products round the probabilities to bf16 (as torch's flash attention on CPU does for bf16), so it is
checked within bf16 tolerance of the exact attention, and for the properties the runtime relies on: a row's
bits do not depend on the batch beside it or on how its prompt was chunked, slots it may not see (NaN
here) never reach it, and bad inputs are refused with the op's name."""

from __future__ import annotations

import pytest
import torch
from test_attention import naive_attention, random_batch

from sgl_lite.runtime.kernels import loader, ops
from sgl_lite.runtime.layers.attention.cpu_kernel import CpuKernelBackend, amx_extend_kernel_available

pytestmark = pytest.mark.skipif(not (loader.load_cpu_ops() and amx_extend_kernel_available()),
                                reason="no AMX tiles here (or the op is not built)")


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, requests: torch.Tensor, kv_indices: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Each request's rows attend its slots up to their own position, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for q_start, new, kv_begin, kv_len in requests.tolist():
        slots = kv_indices[kv_begin : kv_begin + kv_len]
        keys = k_cache[slots].double().repeat_interleave(group, 1)
        values = v_cache[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("thd,lhd->htl", q[q_start : q_start + new].double(), keys) * scale
        hidden = torch.arange(kv_len)[None, :] > (kv_len - new + torch.arange(new))[:, None]
        probs = scores.masked_fill(hidden[None], float("-inf")).softmax(-1)
        out[q_start : q_start + new] = torch.einsum("htl,lhd->thd", probs, values)
    return out


def pool_batch(seed: int, prefixes: list[int], news: list[int], hq: int, hkv: int, d: int):
    """A bf16 pool with every request's keys in scattered slots (the rest NaN), its queries and metadata."""
    g = torch.Generator().manual_seed(seed)
    total = sum(prefixes) + sum(news)
    k_cache = torch.full((2 * total + 8, hkv, d), float("nan"), dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    order = torch.randperm(k_cache.shape[0], generator=g)
    rows, indices, q_start, kv_begin = [], [], 0, 0
    for prefix, new in zip(prefixes, news):
        slots = order[kv_begin : kv_begin + prefix + new]
        k_cache[slots] = (2 * torch.randn(prefix + new, hkv, d, generator=g)).to(torch.bfloat16)
        v_cache[slots] = torch.randn(prefix + new, hkv, d, generator=g).to(torch.bfloat16)
        indices.append(slots)
        rows.append((q_start, new, kv_begin, prefix + new))
        q_start, kv_begin = q_start + new, kv_begin + prefix + new
    q = torch.randn(q_start, hq, d, generator=g).to(torch.bfloat16)
    return q, k_cache, v_cache, torch.tensor(rows, dtype=torch.int64), torch.cat(indices).long()


CASES = {  # (prefixes, new tokens, query heads, KV heads, head_dim)
    "one_short_prompt": ([0], [2], 1, 1, 32),
    "prompt_of_one_tile": ([0], [16], 2, 2, 64),
    "gqa_of_three_over_blocks": ([100, 0, 7], [70, 33, 2], 9, 3, 64),
    "block_edges": ([63, 64, 65], [64, 63, 65], 4, 1, 96),
    "long_prefix_head_128": ([1000], [300], 8, 2, 128),
    "head_256_mqa": ([40], [20], 4, 1, 256),
}
# scale 1 spreads the scores (sd ~16 in base 2): rows' reference maxima move after the first block, so the
# outputs' rescale through memory runs; the default scale (1/sqrt(d)) rarely gets there
SCALES = {"gqa_of_three_over_blocks": 1.0, "block_edges": 1.0}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_exact_attention_within_bf16(case: str) -> None:
    prefixes, news, hq, hkv, d = CASES[case]
    q, k_cache, v_cache, requests, indices = pool_batch(0, prefixes, news, hq, hkv, d)
    scale = SCALES.get(case, d**-0.5)
    out = torch.zeros_like(q)
    ops.amx_extend_attention(q, k_cache, v_cache, requests, indices, scale, out)
    expected = reference(q, k_cache, v_cache, requests, indices, scale)
    error = (out.double() - expected).abs()
    assert error.max() < 0.02 + 0.02 * expected.abs().max(), f"largest error {error.max():.4f}"
    assert error.mean() < 4e-3  # mostly the output's own bf16 rounding


@pytest.mark.parametrize("scale", [64**-0.5, 1.0])
def test_rows_do_not_depend_on_the_batch_or_the_chunking(scale: float) -> None:
    """A request alone, beside others, and its prompt split in two chunks (the second over the first as a
    prefix): the same bits (scale 1: with the rows' reference maxima moving, see SCALES)."""
    q, k_cache, v_cache, requests, indices = pool_batch(1, [130, 0, 500], [150, 40, 90], 8, 4, 64)
    batched = torch.zeros_like(q)
    ops.amx_extend_attention(q, k_cache, v_cache, requests, indices, scale, batched)
    q_start, new, kv_begin, kv_len = requests[2].tolist()
    alone = torch.zeros_like(q)
    ops.amx_extend_attention(q, k_cache, v_cache, requests[2:], indices, scale, alone)
    assert torch.equal(alone[q_start : q_start + new], batched[q_start : q_start + new])
    q_start, new, kv_begin, kv_len = requests[0].tolist()
    first = 57  # the first chunk's new tokens; the second chunk sees them as cached
    chunks = torch.tensor([[q_start, first, kv_begin, kv_len - new + first], [q_start + first, new - first, kv_begin, kv_len]])
    chunked = torch.zeros_like(q)
    for chunk in chunks:
        ops.amx_extend_attention(q, k_cache, v_cache, chunk[None].contiguous(), indices, scale, chunked)
    assert torch.equal(chunked[q_start : q_start + new], batched[q_start : q_start + new])


def test_the_cpu_kernel_backend_runs_bf16_extends_on_the_tiles() -> None:
    if not loader.has_op("paged_decode_attention"):
        pytest.skip("the CPU decode kernel is not built")
    prefixes, news = [0, 150, 7, 40, 3], [70, 90, 1, 64, 5]
    pool, meta, q, k, v = random_batch(7, prefixes, news, 8, 2, d=64, dtype=torch.bfloat16)
    backend = CpuKernelBackend(8, 2, 64, torch.ops.sgl_lite.paged_decode_attention)
    backend.prepare(meta)
    out = backend.forward(0, q, k, v, pool)
    direct = torch.zeros_like(q)
    ops.amx_extend_attention(q, pool.k[0], pool.v[0], backend._extend_table, meta.kv_indices, 64**-0.5, direct)
    extend_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(meta.qo_indptr.tolist(), news) if n > 1])
    assert torch.equal(out[extend_rows], direct[extend_rows])
    assert backend._sdpa_extends is None  # nothing went through SDPA
    assert (out.double() - naive_attention(meta, 0, q, pool).double()).abs().max() < 0.05


@pytest.mark.parametrize(
    ("change", "message"),
    [("float32", "must be bf16"), ("head_dim_48", "multiple of 32"), ("foreign_slot", "slot outside"),
     ("rows_out_of_range", "out of range"), ("zero_scale", "scale must be positive")],
)
def test_bad_inputs_are_refused_by_name(change: str, message: str) -> None:
    q, k_cache, v_cache, requests, indices = pool_batch(2, [10], [20], 2, 1, 64)
    if change == "float32":
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    elif change == "head_dim_48":
        q, k_cache, v_cache = q[..., :48].contiguous(), k_cache[..., :48].contiguous(), v_cache[..., :48].contiguous()
    elif change == "foreign_slot":
        indices = indices.clone()
        indices[3] = k_cache.shape[0]
    elif change == "rows_out_of_range":
        requests = torch.tensor([[5, 20, 0, 30]])
    scale = 0.0 if change == "zero_scale" else 0.125
    with pytest.raises(RuntimeError, match=message) as raised:
        ops.amx_extend_attention(q, k_cache, v_cache, requests, indices, scale, torch.zeros_like(q))
    assert "amx_extend_attention" in str(raised.value)
