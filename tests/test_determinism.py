"""--enable-deterministic-inference: bf16 greedy results independent of the prefix cache and of batching.

The cause of the dependence is attention (its reduction order follows the call's shape); the
linear layers' rows are checked here to be independent of the batch size on this CPU's kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_attention import CASES, naive_attention, random_batch

from sgl_lite.runtime.layers.attention import AttentionBackend, AttentionMetadata, create_backend
from sgl_lite.runtime.layers.attention.batch_invariant import BatchInvariantBackend
from sgl_lite.runtime.layers.attention.cpu_kernel import amx_extend_kernel_takes, extend_kernel_available
from sgl_lite.runtime.layers.linear import GemvLinear, cpu_packed_linear_supported, dense_forms, linear
from sgl_lite.runtime.layers.onednn import amx_matmuls
from sgl_lite.runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool
from sgl_lite.runtime.server.engine import Engine

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention shape


@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_invariant_backend_matches_naive(case: str) -> None:
    prefix_lens, extend_lens, hq, hkv = CASES[case]
    pool, meta, q, k, v = random_batch(3, prefix_lens, extend_lens, hq, hkv)
    backend = BatchInvariantBackend(hq, hkv, q.shape[-1])
    backend.prepare(meta)
    out = backend.forward(1, q, k, v, pool)
    torch.testing.assert_close(out, naive_attention(meta, 1, q, pool), atol=1e-5, rtol=1e-5)


def _rows(backend_cls: Callable[[int, int, int], AttentionBackend], seq: int, splits: list[tuple[int, int]], others: int = 0) -> torch.Tensor:
    """Output rows of one request of `seq` tokens computed as extends (prefix, extend) in turn, the
    request batched after `others` unrelated requests; K/V/Q of every position are fixed by seed."""
    g = torch.Generator().manual_seed(0)
    q_all = torch.randn(seq, HQ, D, generator=g).bfloat16()
    k_all, v_all = torch.randn(seq, HKV, D, generator=g).bfloat16(), torch.randn(seq, HKV, D, generator=g).bfloat16()
    pool = KVPool(num_layers=1, num_slots=seq + 64 * others + 8, kv_heads=HKV, head_dim=D, dtype=torch.bfloat16)
    table = ReqToTokenPool(max_requests=others + 2, max_context=seq + 64)
    row = table.alloc()
    table.table[row, :seq] = torch.arange(1, seq + 1)
    backend = backend_cls(HQ, HKV, D)
    outputs = []
    for prefix, extend in splits:
        rows, prefixes, extends, locs, qs, ks, vs = [], [], [], [], [], [], []
        for o in range(others):  # unrelated requests ahead in the batch: 37 new tokens each
            other_row = table.alloc()
            slots = torch.arange(seq + 1 + 64 * o, seq + 1 + 64 * o + 37)
            table.table[other_row, :37] = slots
            rows.append(other_row), prefixes.append(0), extends.append(37), locs.append(slots)
            qs.append(torch.randn(37, HQ, D, generator=g).bfloat16())
            ks.append(torch.randn(37, HKV, D, generator=g).bfloat16()), vs.append(torch.randn(37, HKV, D, generator=g).bfloat16())
        rows.append(row), prefixes.append(prefix), extends.append(extend)
        locs.append(torch.arange(1 + prefix, 1 + prefix + extend))
        new = slice(prefix, prefix + extend)
        qs.append(q_all[new]), ks.append(k_all[new]), vs.append(v_all[new])
        meta = AttentionMetadata.build(rows, prefixes, extends, torch.cat(locs), table)
        backend.prepare(meta)
        outputs.append(backend.forward(0, torch.cat(qs), torch.cat(ks), torch.cat(vs), pool)[-extend:])
        for other_row in rows[:-1]:
            table.free(other_row)
    return torch.cat(outputs)


def _default_cpu_backend(hq: int, hkv: int, d: int) -> AttentionBackend:
    return create_backend("auto", torch.device("cpu"), hq, hkv, d)


@pytest.mark.parametrize("backend_cls", [BatchInvariantBackend, _default_cpu_backend], ids=["batch_invariant", "cpu_default"])
def test_rows_independent_of_cache_split_and_batch(backend_cls: Callable[[int, int, int], AttentionBackend]) -> None:
    full = _rows(backend_cls, 150, [(0, 150)])
    variants = {
        "cached prefix + suffix": _rows(backend_cls, 150, [(0, 100), (100, 50)]),
        "chunked": _rows(backend_cls, 150, [(0, 64), (64, 64), (128, 22)]),
        "token by token at the end": _rows(backend_cls, 150, [(0, 147), (147, 1), (148, 1), (149, 1)]),
        "batched with others": _rows(backend_cls, 150, [(0, 150)], others=3),
    }
    same = {name: torch.equal(rows, full) for name, rows in variants.items()}
    if backend_cls is BatchInvariantBackend:
        assert all(same.values()), same
    elif amx_extend_kernel_takes(torch.bfloat16, torch.bfloat16, D) or (extend_kernel_available() and not amx_matmuls()):
        # The default backend's extend kernels compute a row from its own keys in fixed blocks (csrc/attention/extend_attention.cpp,
        # and csrc/attention/amx_extend_attention.cpp for bf16 on AMX): splitting or batching a prompt changes nothing. Decoding the
        # last tokens one by one goes through the decode kernel, whose sums run in another order, so that variant may
        # differ in bf16: what the flag is for. (On AMX without the AMX kernel, long extends go through torch's SDPA,
        # whose rows follow the call's shape: the flag's case too.)
        assert same["cached prefix + suffix"] and same["chunked"] and same["batched with others"], same


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill_batch_invariant"])
@pytest.mark.parametrize("k_dim,n_dim", [(576, 960), (576, 3072), (1536, 576), (576, 49152), (64, 128), (128, 64)])
def test_linear_rows_independent_of_batch_size(k_dim: int, n_dim: int, prefill: bool) -> None:
    """The premise of attention-only batch invariance: a row of x @ W.T in bf16, as the model computes it
    (the forms pack_weights makes: the small-row kernel, and oneDNN above its row limit where it has one),
    is the same whatever the number of rows around it on the same kernel (shapes of SmolLM2-135M and of
    the tiny test model). oneDNN alone does not promise it: on AMX hosts its bf16 rows at N=49152 change
    above 32 rows, and there the small-row kernel takes every call: in a decode forward, and in a prefill
    forward with the weights packed batch invariant (--enable-deterministic-inference)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(n_dim, k_dim, generator=g).bfloat16()
    x = torch.randn(300, k_dim, generator=g).bfloat16()
    forms = dense_forms(weight, cpu_packed_linear_supported(torch.bfloat16, torch.device("cpu")), batch_invariant=prefill)
    limit = forms.max_rows if isinstance(forms, GemvLinear) and forms.max_rows is not None else None
    if isinstance(forms, GemvLinear):
        assert forms.prefill_max_rows == forms.max_rows or not prefill

    def row_7(m: int) -> torch.Tensor:
        rows = x[:m] if m > 7 else x[7 - m + 1 : 8]
        return linear(rows, weight, None, forms, prefill)[7 if m > 7 else m - 1]

    small, large = row_7(1), (row_7(limit + 1) if limit is not None else None)
    for m in (2, 5, 16, 31, 64, 128, 300):
        assert torch.equal(row_7(m), small if limit is None or m <= limit else large), m


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    return [out["output_ids"] for out in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.mark.timeout(900)
def test_engine_greedy_same_cold_cached_alone_batched(tiny_llama_dir: Path) -> None:
    engine = Engine(model_path=str(tiny_llama_dir), dtype="bfloat16", max_total_tokens=4096,
                    chunked_prefill_size=48, enable_deterministic_inference=True, log_level="warning")
    try:
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (23, 70, 41)]
        alone_cold = []
        for p in prompts:
            engine.flush_cache()
            alone_cold.append(_greedy(engine, [p])[0])
        engine.flush_cache()
        for p in prompts:  # cache a prefix only: the rest is computed over it
            _greedy(engine, [p[: len(p) // 2]])
        half_cached = [_greedy(engine, [p])[0] for p in prompts]
        cached = [_greedy(engine, [p])[0] for p in prompts]
        engine.flush_cache()
        batched_cold = _greedy(engine, prompts)
        assert half_cached == alone_cold
        assert cached == alone_cold
        assert batched_cold == alone_cold
    finally:
        engine.shutdown()
        engine.core.scheduler.check_invariant()
