"""Quantization (--quantization): the weight-only int8/int4 kernels against matmuls with their own
dequantized weights, the GGUF Q4 block reader against gguf's dequantizer, a tiny model served
quantized end to end, greedy-identical to transformers on weights that the quantization represents exactly;
w8a8_int8's kernel against its torch reference (bit for bit) and that against exact matmuls (within the
quantization's error), and a tiny model served with it computing the reference's arithmetic; the int8
kernels' rows (w4a8_int4's too) independent of the batch and the threads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sgl_lite.runtime.kernels.loader import load_cpu_ops
from sgl_lite.runtime.layers.linear import AVX2_INT4_MAX_ROWS, QuantizedLinear, avx2_int4_preferred, quantize_linear
from sgl_lite.runtime.layers.quantization import QUANTIZATION_METHODS
from sgl_lite.runtime.layers.quantization.gguf_blocks import read_int4_blocks
from sgl_lite.runtime.layers.quantization.w4a8 import W4A8Int4
from sgl_lite.runtime.layers.quantization.w8a8 import W8A8Int8, W8A16Int8, w8a8_kernel_available
from sgl_lite.runtime.layers.quantization.weight_only import Int4Avx2, Int4Values, Int4WeightOnly, Int8WeightOnly
from sgl_lite.runtime.server_args import QUANTIZATIONS, ServerArgs

ROWS = (1, 2, 3, 8, 33)
WEIGHT_ONLY = ("w8a16_int8", "w4a16_int4")  # activations stay dense: exact where the weights are representable


def _reference(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    return x.double() @ dequantized.double().t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_int8_kernel_matches_its_dequantized_weight(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(100, 96, generator=g)  # N not a multiple of 16, K of 32: any shape works
    q = Int8WeightOnly.quantize(weight, dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    ref = _reference(x, q.weight.float() * q.scales.float()[:, None])  # the scales as the kernel sees them
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(q.matmul(x).double(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    if dtype == torch.float32:  # and the quantization itself is round-to-nearest: within half a step
        assert ((q.dequantize() - weight).abs() <= q.scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features", [128, 100])  # 100: padded to the kernel's multiple of 16
def test_int4_kernel_matches_its_dequantized_weight(dtype: torch.dtype, rows: int, out_features: int) -> None:
    g = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, 96, generator=g)
    values = Int4Values.quantize(weight)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    out = Int4WeightOnly(values, dtype).matmul(x)
    assert out.shape == (rows, out_features)
    rounded = Int4Values(values.q, values.scales.to(dtype).float(), (values.mins + 8 * values.scales).to(dtype).float()
                         - 8 * values.scales.to(dtype).float())
    ref = _reference(x, rounded.dequantize())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    groups = values.scales.repeat_interleave(32, dim=1)
    assert ((values.dequantize() - weight).abs() <= groups / 2 + 1e-5).all()


AVX2_INT4 = pytest.mark.skipif(not (load_cpu_ops() and torch.ops.sgl_lite.avx2_q4_gemv_supported()),
                               reason="the AVX2 int4 kernel needs AVX2, FMA and F16C")


@AVX2_INT4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 40])
@pytest.mark.parametrize("shape", [(128, 96), (100, 64), (960, 576)])  # 100: padded to a multiple of 16
def test_avx2_int4_kernel_matches_its_dequantized_weight(dtype: torch.dtype, rows: int, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(rows + shape[0])
    n, k = shape
    weight, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g).to(dtype)
    values = Int4Values.quantize(weight)
    assert torch.equal(values.scales, values.scales.half().float())  # stored as fp16, as Q4_1 does
    x = torch.randn(rows, k, generator=g).to(dtype)
    out = Int4Avx2(values).matmul(x, bias)
    assert out.shape == (rows, n) and out.dtype == dtype
    ref = _reference(x, values.dequantize()) + bias.double()
    # float32 sums in another order than the reference's, plus one rounding to bf16
    tol = ref.abs() * (2**-8 if dtype == torch.bfloat16 else 1e-6) + 1e-5 * k
    assert ((out.double() - ref).abs() <= tol).all()


@AVX2_INT4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_int4_rows_do_not_depend_on_the_batch_or_the_threads(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    form = Int4Avx2(Int4Values.quantize(torch.randn(576, 1536, generator=g)))
    x = torch.randn(AVX2_INT4_MAX_ROWS, 1536, generator=g).to(dtype)
    batched = form.matmul(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows in (1, 2, 3, 4, 5, 13):
            assert torch.equal(form.matmul(x[:rows]), batched[:rows]), rows
    finally:
        torch.set_num_threads(threads)


@AVX2_INT4
def test_avx2_int4_kernel_refuses_a_malformed_weight() -> None:
    form = Int4Avx2(Int4Values.quantize(torch.randn(32, 64)))
    with pytest.raises(RuntimeError, match="packed weight must be"):
        torch.ops.sgl_lite.avx2_q4_gemv(torch.randn(1, 96), form.packed, None)  # K = 96 against blocks of K = 64
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.sgl_lite.avx2_q4_gemv(torch.randn(1, 64), form.packed, torch.zeros(31))
    with pytest.raises(ValueError, match="fit fp16"):
        Int4Avx2(Int4Values(torch.zeros(16, 32, dtype=torch.uint8), torch.full((16, 1), 1e6), torch.zeros(16, 1)))


def test_int4_takes_the_avx2_kernel_where_torch_has_no_wider_vectors() -> None:
    layer = quantize_linear("w4a16_int4", torch.randn(64, 64), None)
    if avx2_int4_preferred():
        assert isinstance(layer.quantized, Int4Avx2) and layer.max_rows == AVX2_INT4_MAX_ROWS
    else:
        assert isinstance(layer.quantized, Int4WeightOnly)


def test_quantized_linear_picks_the_kernel_by_row_count() -> None:
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(64, 64, generator=g), torch.randn(64, generator=g)
    layer = quantize_linear("w4a16_int4", weight, None)
    assert isinstance(layer, QuantizedLinear)
    few = torch.randn(layer.max_rows, 64, generator=g)
    many = torch.randn(layer.max_rows + 1, 64, generator=g)
    assert torch.equal(layer(many, weight, bias), F.linear(many, weight, bias))  # dense above the threshold
    quantized = layer.quantized.matmul(few, bias)
    assert torch.equal(layer(few, weight, bias), quantized)
    assert not torch.allclose(quantized, F.linear(few, weight, bias), atol=1e-3)  # so the two paths differ


def test_method_names_agree_and_bad_names_are_refused() -> None:
    assert QUANTIZATIONS == QUANTIZATION_METHODS
    with pytest.raises(ValueError, match="--quantization"):
        ServerArgs(quantization="int3")
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linear("int3", torch.zeros(16, 32), None)
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Values.quantize(torch.zeros(16, 40))


# ---------------------------------------------------------------- GGUF blocks


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, object]], heads: tuple[int, int]) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_head_count(heads[0])
    writer.add_head_count_kv(heads[1])
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_q4_blocks_match_the_gguf_dequantizer(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    dense = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in
             {"blk.0.attn_q.weight": (64, 96), "blk.0.attn_k.weight": (32, 96), "blk.0.ffn_down.weight": (48, 64),
              "output.weight": (80, 64), "blk.0.attn_v.weight": (32, 96)}.items()}
    kinds = {"blk.0.attn_q.weight": T.Q4_1, "blk.0.attn_k.weight": T.Q4_0, "blk.0.ffn_down.weight": T.Q4_1,
             "output.weight": T.Q4_0, "blk.0.attn_v.weight": T.Q8_0}
    blocks = {name: (quantize(w, kinds[name]), kinds[name]) for name, w in dense.items()}
    _write_gguf(tmp_path / "m.gguf", blocks, heads=(4, 2))
    values = read_int4_blocks(tmp_path / "m.gguf")
    # Q8_0 is not a 4-bit format: left to quantization at load
    assert sorted(values) == ["lm_head.weight", "model.layers.0.mlp.down_proj.weight",
                              "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"]

    def expected(name: str, heads: int | None) -> np.ndarray:
        w = dequantize(*blocks[name])
        if heads is None:
            return w
        # transformers' inverse of llama.cpp's q/k row permutation
        return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(2, 1).reshape(w.shape)

    for gguf_name, hf_name, heads in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 4),
                                      ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", 2),
                                      ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
                                      ("output.weight", "lm_head.weight", None)]:
        assert np.array_equal(values[hf_name].dequantize().numpy(), expected(gguf_name, heads)), hf_name


# ---------------------------------------------------------------- a tiny model served quantized


def _exactly_quantizable_copy(src: Path, dst: Path, method: str) -> Path:
    """The tiny model with every matmul weight replaced by its own quantize-dequantize round trip, so
    that `method` represents the weights exactly and dense and quantized kernels compute one function."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name, w in tensors.items():
        if w.dim() == 2:
            q = Int8WeightOnly.quantize(w, torch.float32).dequantize() if method == "w8a16_int8" else \
                Int4Values.quantize(w).dequantize()
            tensors[name] = q.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"]
    return dst


@pytest.mark.parametrize("method", WEIGHT_ONLY)
def test_tiny_model_served_quantized_matches_transformers(method: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from sgl_lite.runtime.server.engine import Engine

    model_dir = _exactly_quantizable_copy(tiny_llama_dir, tmp_path / "model", method)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = Engine(model_path=str(model_dir), max_total_tokens=2048, dtype="float32", device="cpu", quantization=method)
    try:
        layer = engine.core.runner.model.layers[0]
        assert all(isinstance(p, QuantizedLinear) for p in layer.packed.values())
        prompts = ["The quick brown fox", "What is the capital of France?", "def add(a, b):"]
        params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        # one at a time (decode of 1 row: the quantized kernels), then together (3 rows: the int4 kernel on
        # AVX2 CPUs, else the dense one)
        outs = [engine.generate(p, params) for p in prompts] + engine.generate(prompts, params)
        for i, out in enumerate(outs):
            ids = engine.core.tokenizer(prompts[i % 3])["input_ids"]
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert out["output_ids"] == ref[0, len(ids):].tolist(), prompts[i % 3]
    finally:
        engine.shutdown()
    engine.core.scheduler.check_invariant()



# ---------------------------------------------------------------- w8a8_int8

W8A8 = pytest.mark.skipif(not w8a8_kernel_available(), reason="the w8a8 kernel needs AVX512-VNNI (and the C++ ops built)")


@W8A8
@pytest.mark.parametrize("form_type", [W8A8Int8, W8A16Int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 8, 9, 33, 130])
@pytest.mark.parametrize("shape", [(128, 96), (100, 30), (960, 576)])  # 100 x 30: padded columns and k
def test_w8a8_kernel_is_its_torch_reference_bit_for_bit(form_type: type, dtype: torch.dtype, rows: int, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(rows + shape[0])
    n, k = shape
    form = form_type(torch.randn(n, k, generator=g).to(dtype))
    x, bias = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    x[0, : k // 2] = 0  # ties and zeros
    for b in (None, bias):
        out = form.matmul(x, b)
        assert out.shape == (rows, n) and out.dtype == dtype
        assert torch.equal(out, form.reference_matmul(x, b))
    assert torch.equal(form.matmul(torch.zeros(2, k, dtype=dtype)), torch.zeros(2, n, dtype=dtype))  # a zero row


@W8A8
@pytest.mark.parametrize("form_type", [W8A8Int8, W8A16Int8])
def test_w8a8_rows_too_small_to_scale_quantize_to_zeros_in_both(form_type: type) -> None:
    """127 / max|x| overflows below ~3.7e-37 (32767 / max|x| below ~9.6e-35): such a row is a zero row for the
    kernel and the reference alike."""
    form = form_type(torch.randn(32, 8))
    x = torch.tensor([[1e-37, 0.0, -1e-37, 0.0, 0, 0, 0, 0], [1e-30, -2e-30, 0, 0, 0, 0, 0, 3e-30]])
    out = form.matmul(x)
    assert torch.equal(out, form.reference_matmul(x))
    assert torch.equal(out[0], torch.zeros(32)) and out[1].abs().max() > 0


@pytest.mark.parametrize("n", [40, 80, 100])  # 3 blocks (one group), 5 (a last group of 2), 7 (of 1)
def test_w8a8_unpacks_the_weight_it_packed(n: int) -> None:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(n, 30, generator=g)
    form = W8A8Int8(weight)
    expected = torch.round(weight / form.scales[:, None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(form.q, expected)
    assert ((form.dequantize() - weight).abs() <= form.scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_w8a8_reference_is_within_the_quantization_error(rows: int) -> None:
    """|y - x.w| <= sum_k |x_k| dw_k + |w_k| dx_k + dx_k dw_k, with each rounding error at most half a step."""
    g = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(64, 200, generator=g), torch.randn(rows, 200, generator=g) * 3
    form = W8A8Int8(weight)
    out = form.reference_matmul(x).double()
    exact = _reference(x, weight)
    dw = (form.scales / 2).double()[:, None].expand(64, 200)
    dx = (x.abs().amax(1) / 127 / 2).double()[:, None].expand(rows, 200)
    bound = x.abs().double() @ dw.t() + dx @ weight.abs().double().t() + dx @ dw.t()
    assert ((out - exact).abs() <= bound * 1.001 + 1e-4).all()
    assert not torch.allclose(out, exact, atol=1e-4)  # it does quantize


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_w8a16_moves_logits_less_than_8_bit_activations_do(rows: int) -> None:
    """16-bit activations: the error against the exact product within the weights' rounding plus at most half a
    16-bit step per activation, and several times below w8a8's on rows with an outlier (a hidden state's)."""
    g = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(64, 576, generator=g) * 0.05, torch.randn(rows, 576, generator=g)
    x[:, 7] = 40.0  # an outlier sets each row's scale
    w16, w8 = W8A16Int8(weight), W8A8Int8(weight)
    exact = _reference(x, weight)
    err16, err8 = (w16.reference_matmul(x).double() - exact).abs(), (w8.reference_matmul(x).double() - exact).abs()
    dw = (w16.scales / 2).double()[:, None].expand(64, 576)
    dx = (x.abs().amax(1) / 32767 / 2).double()[:, None].expand(rows, 576)
    bound = x.abs().double() @ dw.t() + dx @ weight.abs().double().t() + dx @ dw.t()
    assert (err16 <= bound * 1.001 + 1e-5).all()
    weights_only = (x.double() @ w16.dequantize().double().t() - exact).abs()
    assert (err16 - weights_only).abs().max() < 0.05 * weights_only.max()  # the activations add little
    assert err8.mean() > 3 * err16.mean()


@W8A8
@pytest.mark.parametrize("form_type", [W8A8Int8, W8A16Int8, lambda w: W4A8Int4(Int4Values.quantize(w))], ids=["w8a8", "w8a16", "w4a8"])
def test_int8_kernels_rows_do_not_depend_on_the_batch_or_the_threads(form_type) -> None:
    g = torch.Generator().manual_seed(6)
    form = form_type(torch.randn(576, 1536, generator=g))
    x = torch.randn(70, 1536, generator=g).to(torch.bfloat16)
    batched = form.matmul(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows in (1, 3, 9, 17):
            assert torch.equal(form.matmul(x[:rows]), batched[:rows]), rows
    finally:
        torch.set_num_threads(threads)


@W8A8
def test_w8a8_kernel_refuses_a_malformed_weight() -> None:
    form = W8A8Int8(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="packed weight must be"):
        torch.ops.sgl_lite.w8a8_gemm(torch.randn(1, 96), form.packed, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.sgl_lite.w8a8_gemm(torch.randn(1, 64), form.packed, torch.zeros(31))
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.sgl_lite.w8a8_gemm(torch.randn(1, 64).double(), form.packed, None)
    with pytest.raises(RuntimeError, match="w8a16_gemm: packed weight must be"):
        torch.ops.sgl_lite.w8a16_gemm(torch.randn(1, 96), form.packed, None)


def test_w8a8_takes_every_call_and_keeps_no_dense_copy() -> None:
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    layer = quantize_linear("w8a8_int8", weight, None)
    assert isinstance(layer.quantized, W8A8Int8) and layer.packed_dense is None and layer.takes(100_000)
    many = torch.randn(300, 64, generator=g)
    assert torch.equal(layer(many, weight, bias), layer.quantized.matmul(many, bias))


@W8A8
def test_tiny_model_served_w8a8_computes_the_reference_arithmetic(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Served with the kernels (the fused decode layer included) and with the torch references in every matmul,
    the same greedy tokens, alone and batched; the LM head takes 16-bit activations."""
    from sgl_lite.runtime.server.engine import Engine

    prompts = ["The quick brown fox", "What is the capital of France?", "def add(a, b):"]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    def serve() -> list[list[int]]:
        engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=2048, dtype="bfloat16", device="cpu",
                        quantization="w8a8_int8")
        try:
            model = engine.core.runner.model
            assert all(isinstance(p, QuantizedLinear) and isinstance(p.quantized, W8A8Int8)
                       for layer in model.layers for p in layer.packed.values())
            assert isinstance(model.packed_lm_head, QuantizedLinear) and isinstance(model.packed_lm_head.quantized, W8A16Int8)
            outs = [engine.generate(p, params) for p in prompts] + engine.generate(prompts, params)
            engine.core.scheduler.check_invariant()
            return [o["output_ids"] for o in outs]
        finally:
            engine.shutdown()

    kernel = serve()
    monkeypatch.setattr(W8A8Int8, "fused_decode_weight", property(lambda self: False))
    monkeypatch.setattr(W8A8Int8, "matmul", W8A8Int8.reference_matmul)
    monkeypatch.setattr(W8A16Int8, "matmul", W8A16Int8.reference_matmul)
    assert serve() == kernel
    assert kernel[:3] == kernel[3:]  # alone and batched
