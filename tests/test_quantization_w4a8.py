"""`--quantization w4a8_int4`: csrc/matmul/w4a8_gemm.cpp (4-bit weights by int8 activations) against its torch
reference and that against exact matmuls (within the quantization's error), its packing and refusals (its
batch and thread invariance: test_quantization.py); the forms a weight gets (few rows on that kernel, many on the int4 values in int8,
no dense copy); the fused decode layer on it, bit for bit; and a tiny model served with it: its prompt
logprobs against transformers' on the int4 values, and its tokens against the torch references.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_decode_layer_op import decode_hidden, prepare_decode, without_fusion
from test_model import Driver, make_runner, prompts

from sgl_lite.runtime.layers.linear import (
    QUANTIZED_MAX_ROWS,
    W4A8_MAX_ROWS,
    QuantizedLinear,
    linear,
    quantize_linear,
    reads_dense_weight,
)
from sgl_lite.runtime.layers.quantization.w4a8 import W4A8Int4, w4a8_kernel_available
from sgl_lite.runtime.layers.quantization.w8a8 import W8A8Int8, W8A16Int8
from sgl_lite.runtime.layers.quantization.weight_only import Int4Values
from sgl_lite.runtime.model_executor.model_runner import ModelRunner

W4A8 = pytest.mark.skipif(not w4a8_kernel_available(), reason="the w4a8 kernel needs AVX512-VNNI (and the C++ ops built)")
PROMPTS = ["The quick brown fox", "What is the capital of France?", "def add(a, b):"]


def _form(n: int, k: int, seed: int) -> tuple[W4A8Int4, Int4Values]:
    values = Int4Values.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return W4A8Int4(values), values


@pytest.mark.parametrize("shape", [(64, 128), (100, 96), (960, 576)])  # 100: padded columns
def test_the_packing_unpacks_to_its_values(shape: tuple[int, int]) -> None:
    form, values = _form(*shape, seed=1)
    unpacked = form.unpacked()
    assert torch.equal(unpacked.q, values.q)
    assert torch.equal(unpacked.scales, values.scales.half().float()) and torch.equal(unpacked.mins, values.mins.half().float())


@W4A8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(128, 96), (100, 64), (960, 576)])
def test_w4a8_kernel_is_its_torch_reference_within_float32_rounding(dtype: torch.dtype, rows: int, shape: tuple[int, int]) -> None:
    """The same integer sums; the kernel's float32 sums over the groups (fused multiply-adds) against float64."""
    form, _ = _form(*shape, seed=rows)
    g = torch.Generator().manual_seed(rows + 7)
    x, bias = torch.randn(rows, shape[1], generator=g).to(dtype), torch.randn(shape[0], generator=g)
    out = form.matmul(x, bias).double()
    reference = form.reference_matmul(x.float(), bias).double()  # float32 out: only the kernel's own roundings
    step = {torch.float32: 2**-20, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    assert ((out - reference).abs() <= step * reference.abs().max()).all()


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_w4a8_reference_is_within_the_activations_rounding(rows: int) -> None:
    """The weights are the int4 values exactly: |y - x.w| <= sum_k |w_k| dx_k, dx_k at most half a step."""
    form, values = _form(64, 256, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * 3
    weight = form.unpacked().dequantize().double()
    out, exact = form.reference_matmul(x).double(), x.double() @ weight.t()
    dx = (x.abs().amax(1) / 127 / 2).double()[:, None]
    assert ((out - exact).abs() <= dx * weight.abs().sum(1)[None] * 1.001 + 1e-6).all()
    assert not torch.allclose(out, exact, atol=1e-4)  # it does quantize


@W4A8
def test_w4a8_kernel_refuses_a_malformed_call() -> None:
    form, _ = _form(32, 64, seed=0)
    with pytest.raises(RuntimeError, match="packed weight must be"):
        torch.ops.sgl_lite.w4a8_gemm(torch.randn(1, 96), form.packed, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.sgl_lite.w4a8_gemm(torch.randn(1, 48), form.packed, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.sgl_lite.w4a8_gemm(torch.randn(1, 64), form.packed, torch.zeros(31))
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.sgl_lite.w4a8_gemm(torch.randn(1, 64).double(), form.packed, None)


def test_few_rows_take_the_int4_form_and_many_the_int4_values_in_int8() -> None:
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
    values = Int4Values.quantize(weight)
    layer = quantize_linear("w4a8_int4", weight, None)
    # the 4-bit kernel up to its own row limit; torch's int4 kernel, where it is the path, up to the weight-only one
    assert layer.max_rows == (W4A8_MAX_ROWS if w4a8_kernel_available() else QUANTIZED_MAX_ROWS)
    assert (type(layer.quantized) is W4A8Int4) == w4a8_kernel_available()
    many = layer.packed_dense
    assert isinstance(many, QuantizedLinear) and type(many.quantized) is W8A8Int8 and many.takes(100_000)
    assert not reads_dense_weight(layer)  # the model drops its dense weight
    # the int8 weights are the int4 values rounded per output column: within half an int8 step
    assert ((many.quantized.dequantize() - values.dequantize()).abs() <= many.quantized.scales[:, None] / 2 + 1e-6).all()
    few, rows = torch.randn(layer.max_rows, 128, generator=g), torch.randn(layer.max_rows + 5, 128, generator=g)
    assert torch.equal(linear(few, weight, bias, layer), layer.quantized.matmul(few, bias))
    assert torch.equal(linear(rows, weight, bias, layer), many.quantized.matmul(rows, bias))


@W4A8
def test_the_fused_decode_layer_runs_the_w4a8_kernel_bit_for_bit(tiny_llama_dir: Path) -> None:
    plain = make_runner(tiny_llama_dir, dtype="bfloat16")
    runner = ModelRunner(plain.args.replace(quantization="w4a8_int4"), model_dir=plain.model_dir)
    layers = runner.model.layers
    assert all(w.dtype == torch.uint8 and w.dim() == 2 for layer in layers for w in layer.fused_decode_weights(W4A8_MAX_ROWS))
    assert all(w.dtype == torch.int8 for layer in layers for w in layer.fused_decode_weights(W4A8_MAX_ROWS + 1))
    driver = Driver(runner)
    reqs = [driver.new_req(str(i), ids) for i, ids in enumerate(prompts(runner.vocab_size, [5, 17], seed=3))]
    driver.generate(reqs, 1)
    slots = torch.arange(1000, 1002)
    prepare_decode(runner, reqs, slots)
    assert runner.attn.decode_kernel_inputs(runner.kv_pool) is not None
    fused = decode_hidden(runner, reqs, slots)
    without_fusion(runner)
    assert torch.equal(fused, decode_hidden(runner, reqs, slots))


def _int4_exact_copy(src: Path, dst: Path) -> Path:
    """The tiny model with every matmul weight replaced by its own int4 round trip: the model the int4 forms
    compute, within the activations' rounding (and the int8 form's, for calls of many rows)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name, w in tensors.items():
        if w.dim() == 2:
            tensors[name] = Int4Values.quantize(w).dequantize().contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"]
    return dst


@W4A8
def test_tiny_model_served_w4a8_int4_keeps_transformers_logprobs_and_the_reference_tokens(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from sgl_lite.runtime.server.engine import Engine

    model_dir = _int4_exact_copy(tiny_llama_dir, tmp_path / "model")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    def serve(check_forms: bool) -> list[dict]:
        engine = Engine(model_path=str(model_dir), max_total_tokens=2048, dtype="float32", device="cpu",
                        quantization="w4a8_int4")
        try:
            model = engine.core.runner.model
            if check_forms:
                for layer in model.layers:
                    assert all(isinstance(p.quantized, W4A8Int4) for p in layer.packed.values())
                    assert layer.qkv_weight.device.type == "meta"  # no dense copy kept
                assert isinstance(model.packed_lm_head.quantized, W8A16Int8)
            # one at a time: prefill on the int8 form, decode of 1 row on the int4 kernel; together, 3 rows on the
            # int4 kernel too, and 6 (more than W4A8_MAX_ROWS) on the int8 form
            outs = [engine.generate(p, params, return_logprob=True, logprob_start_len=0) for p in PROMPTS]
            outs += engine.generate(PROMPTS, params) + engine.generate(PROMPTS * 2, params)
            engine.core.scheduler.check_invariant()
            return outs
        finally:
            engine.shutdown()

    kernel = serve(check_forms=True)
    for prompt, out in zip(PROMPTS, kernel):
        served = [lp for lp, _tok, _ in out["meta_info"]["input_token_logprobs"][1:]]
        ids = [tok for _lp, tok, _ in out["meta_info"]["input_token_logprobs"]]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        reference = [logits[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
        assert len(served) == len(reference) > 2
        assert max(abs(a - b) for a, b in zip(served, reference)) < 0.1, (prompt, served, reference)

    for form in (W4A8Int4, W8A8Int8, W8A16Int8):
        monkeypatch.setattr(form, "matmul", form.reference_matmul)
    monkeypatch.setattr(W4A8Int4, "fused_decode_weight", property(lambda self: False))
    monkeypatch.setattr(W8A8Int8, "fused_decode_weight", property(lambda self: False))
    assert [o["output_ids"] for o in serve(check_forms=False)] == [o["output_ids"] for o in kernel]
