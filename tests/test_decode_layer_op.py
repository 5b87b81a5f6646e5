"""The fused decode layer (kernels/csrc/layer/decode_layer.cpp) against the Python layer it replaces, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_model import Driver, make_runner, prompts

from sgl_lite.runtime.layers.attention.base import AttentionMetadata
from sgl_lite.runtime.layers.linear import avx2_int4_preferred, gemv_supported
from sgl_lite.runtime.model_executor.model_runner import ModelRunner

# The fused layer runs in the dtypes whose small-row kernel this CPU has: bf16 on AVX512-BF16, float32 on
# AVX2 + FMA (both on AVX-512 CPUs); KERNEL_DTYPE is the first of them.
KERNEL_DTYPES = [name for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))
                 if gemv_supported(torch.empty(16, 2, dtype=dtype))]
KERNEL_DTYPE = KERNEL_DTYPES[0] if KERNEL_DTYPES else None
pytestmark = pytest.mark.skipif(KERNEL_DTYPE is None, reason="no small-row matmul kernel on this CPU")


@pytest.fixture(params=[(model, dtype) for model in ("llama", "qwen2", "llama-int4") for dtype in KERNEL_DTYPES or [None]],
                ids=lambda param: f"{param[0]}-{param[1]}")
def runner(request, tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> ModelRunner:
    model, dtype = request.param
    runner = make_runner(tiny_llama_dir if model != "qwen2" else tiny_qwen2_dir, dtype=dtype)
    if model == "llama-int4":
        runner = ModelRunner(runner.args.replace(quantization="w4a16_int4"), model_dir=runner.model_dir)
        if not avx2_int4_preferred():  # torch's int4 kernel, up to 2 rows: the batch of 3 below goes to the small-row kernel
            assert all(layer.fused_decode_weights(2) is None for layer in runner.model.layers)
        else:  # the AVX2 int4 kernel is fused too, up to its row limit
            assert all(w.dtype == torch.uint8 for layer in runner.model.layers for w in layer.fused_decode_weights(3))
    return runner


def without_fusion(runner: ModelRunner) -> None:
    runner.attn.decode_kernel_inputs = lambda kv_pool: None  # the per-op Python path


def prepare_decode(runner: ModelRunner, reqs, slots: torch.Tensor) -> None:
    for req, slot in zip(reqs, slots.tolist()):
        runner.req_to_token.table[req.req_pool_idx, req.kv_len] = slot
    runner.attn.prepare(AttentionMetadata.build([r.req_pool_idx for r in reqs], [r.kv_len for r in reqs], [1] * len(reqs),
                                                slots, runner.req_to_token))


def decode_hidden(runner: ModelRunner, reqs, slots: torch.Tensor) -> torch.Tensor:
    """Hidden states of one decode step over `reqs`, their new K/V written at `slots`."""
    prepare_decode(runner, reqs, slots)
    ids = torch.tensor([r.output_ids[-1] for r in reqs])
    positions = torch.tensor([r.kv_len for r in reqs])
    return runner.model(ids, positions, runner.attn, runner.kv_pool)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_fused_decode_step_is_bit_identical_to_the_python_layers(runner: ModelRunner, kv: str) -> None:
    """The same hidden states and the same K/V stored, in a pool of the model's dtype or of 8-bit floats
    (which the op saturates and rounds as KVPool.write does)."""
    if kv != "auto":
        runner = ModelRunner(runner.args.replace(kv_cache_dtype=kv), model_dir=runner.model_dir)
    driver = Driver(runner)
    reqs = [driver.new_req(str(i), ids) for i, ids in enumerate(prompts(runner.vocab_size, [5, 17, 33], seed=3))]
    driver.generate(reqs, 1)
    slots = torch.arange(1000, 1003)
    prepare_decode(runner, reqs, slots)
    assert runner.attn.decode_kernel_inputs(runner.kv_pool) is not None
    assert all(layer.fused_decode_weights(len(reqs)) is not None for layer in runner.model.layers)
    fused = decode_hidden(runner, reqs, slots)
    k_fused, v_fused = runner.kv_pool.k[1][slots].clone(), runner.kv_pool.v[1][slots].clone()
    without_fusion(runner)
    runner.kv_pool.k[1][slots] = 0
    runner.kv_pool.v[1][slots] = 0
    reference = decode_hidden(runner, reqs, slots)
    assert torch.equal(fused, reference)
    # the fused op stored the same K and V
    assert torch.equal(runner.kv_pool.k[1][slots], k_fused) and torch.equal(runner.kv_pool.v[1][slots], v_fused)


def test_greedy_decoding_is_the_same_with_and_without_fusion(tiny_llama_dir: Path) -> None:
    outputs = []
    for fused in (True, False):
        runner = make_runner(tiny_llama_dir, dtype=KERNEL_DTYPE)
        if not fused:
            without_fusion(runner)
        driver = Driver(runner)
        reqs = [driver.new_req(str(i), ids) for i, ids in enumerate(prompts(runner.vocab_size, [4, 9, 23, 40], seed=8))]
        outputs.append(driver.generate(reqs, 12))
    assert outputs[0] == outputs[1]


def test_extend_batches_take_the_python_path_and_fp8_pools_the_fused_one(tiny_llama_dir: Path) -> None:
    runner = make_runner(tiny_llama_dir, dtype=KERNEL_DTYPE)
    driver = Driver(runner)
    req = driver.new_req("a", prompts(runner.vocab_size, [6], seed=1)[0])
    meta = AttentionMetadata.build([req.req_pool_idx], [0], [6], torch.arange(1, 7), runner.req_to_token)
    runner.attn.prepare(meta)
    assert runner.attn.decode_kernel_inputs(runner.kv_pool) is None  # an extend row
    fp8 = ModelRunner(runner.args.replace(kv_cache_dtype="fp8_e4m3"), model_dir=runner.model_dir)
    meta = AttentionMetadata.build([req.req_pool_idx], [5], [1], torch.arange(6, 7), fp8.req_to_token)
    fp8.attn.prepare(meta)
    assert fp8.attn.decode_kernel_inputs(fp8.kv_pool) is not None


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_the_fused_op_saturates_an_fp8_pool_as_kv_pool_write_does(tiny_llama_dir: Path, kv: str) -> None:
    """K/V far beyond the format's range (the qkv bias scaled up) are stored as its largest finite value, as
    KVPool.write stores them, not as inf or NaN."""
    runner = make_runner(tiny_llama_dir, dtype=KERNEL_DTYPE)
    runner = ModelRunner(runner.args.replace(kv_cache_dtype=kv), model_dir=runner.model_dir)
    layer = runner.model.layers[0]
    layer.qkv_bias = torch.full((layer.q_size + 2 * layer.kv_size,), 1e6, dtype=runner.dtype)
    layer.qkv_bias[layer.q_size + layer.kv_size :: 2] = -1e6  # some V entries at the negative end
    driver = Driver(runner)
    [req] = [driver.new_req("0", ids) for ids in prompts(runner.vocab_size, [7], seed=5)]
    driver.generate([req], 1)
    slots = torch.tensor([1500])
    stored = []
    for fused in (True, False):
        if not fused:
            without_fusion(runner)
        decode_hidden(runner, [req], slots)
        stored.append((runner.kv_pool.k[0][slots].float(), runner.kv_pool.v[0][slots].float()))
    finite = torch.finfo(runner.kv_pool.dtype).max
    for k, v in stored:
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        assert (v == -finite).any() and (v == finite).any()
    assert all(torch.equal(a, b) for a, b in zip(*stored))


def test_an_out_of_pool_slot_is_refused_not_written(tiny_llama_dir: Path) -> None:
    runner = make_runner(tiny_llama_dir, dtype=KERNEL_DTYPE)
    driver = Driver(runner)
    [req] = [driver.new_req("0", ids) for ids in prompts(runner.vocab_size, [9], seed=4)]
    driver.generate([req], 1)
    outside = torch.tensor([runner.kv_pool.k[0].shape[0] + 5])
    with pytest.raises(RuntimeError, match="out_cache_loc must hold one slot"):
        decode_hidden(runner, [req], outside)


def test_a_layers_operands_follow_its_packed_forms_and_the_pool(tiny_llama_dir: Path) -> None:
    """fused_decode_operands keeps its last answer only while the rows, the packed forms and the pool are
    the ones it was made for: a swapped pool or packed dict (bench_model.py installs both per variant) is
    seen at once."""
    runner = make_runner(tiny_llama_dir, dtype=KERNEL_DTYPE)
    layer, pool = runner.model.layers[1], runner.kv_pool
    weights, caches, heads = layer.fused_decode_operands(3, pool)
    assert caches[0] is pool.k[1] and caches[1] is pool.v[1] and heads == (layer.num_heads, layer.num_kv_heads)
    assert layer.fused_decode_operands(3, pool)[0] is weights  # kept
    other = ModelRunner(runner.args, model_dir=runner.model_dir).kv_pool
    assert layer.fused_decode_operands(3, other)[1][0] is other.k[1]
    layer.packed = dict.fromkeys(layer.packed)  # no small-row forms: the layer runs op by op
    assert layer.fused_decode_operands(3, other) is None
