"""The decode step's C++ kernels against what they replaced, on the default model's shapes, in one run.

- matmuls: the small-row kernel of each dtype it serves here (`kernels/csrc/matmul/bf16_gemv.cpp` for bf16 on
  AVX512-BF16, `avx2_gemv.cpp` for float32 and bf16 on AVX2) against the path before it (oneDNN's packed
  bf16 matmuls where oneDNN has bf16, else torch's F.linear: MKL's sgemm in float32) over 30 layers of
  SmolLM2-135M-shaped random weights (qkv, o, gate_up, down), so that the weights stream from memory as
  in a real step; 1 to 128 rows;
- int4 weights (`--quantization w4a16_int4`): the int4 kernel this CPU runs (`kernels/csrc/matmul/avx2_q4_gemv.cpp`
  on CPUs without AVX-512, else torch's) against the bf16 small-row kernel on the same weights;
- int8 (`--quantization w8a8_int8`, on AVX512-VNNI): `kernels/csrc/matmul/w8a8_gemm.cpp` against the bf16 small-row
  kernel on the same weights, and its LM head (int8 weights x 16-bit activations) against the bf16 head;
- decode attention (`kernels/csrc/attention/paged_decode_attention.cpp`) per layer, 9 query / 3 KV heads of 64 in
  bf16, each of 30 layers with its own K/V pool (read from memory), requests' slots in contiguous runs;
  GB/s of K/V read. Its baseline is the machine's read bandwidth (a sum over 512 MiB, as bench_model); in
  bf16 on AVX512-BF16 CPUs also the arithmetic bf16_gemv's probe did not pick (VDPBF16PS pairs or float32 FMAs);
  and a speculative verification row: one request's 1 + k queries (its last token and k draft tokens,
  query j seeing j more keys) as one kernel row, as the runtime runs them, at 150-2000 tokens of context,
  with what each draft query adds to the layer; its baseline is the same queries as separate decode rows;
- the MLP's activation, silu(gate) * up, as one C++ op (`kernels/csrc/layer/silu_and_mul.cpp`) against torch's two
  ops, in bf16 at SmolLM2-135M's width (1536), 30 layers' inputs, from a decode step's rows to a prefill's;
- the decoder layer of a decode step as one C++ op (`kernels/csrc/layer/decode_layer.cpp`) against the same
  layer called op by op from Python, on the default model (ms per decode step, 480-token contexts).

Each figure is the best of --repeats; the pairs are interleaved. Prints markdown tables, writes JSON and a PNG.
Usage: python scripts/bench_decode_kernels.py [--repeats 5] [--out artifacts/bench_decode_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, save_png  # noqa: E402
from sgl_lite.runtime.kernels import ops  # noqa: E402
from sgl_lite.runtime.kernels.loader import bf16_arithmetic  # noqa: E402
from sgl_lite.runtime.layers.linear import (  # noqa: E402
    GemvLinear,
    QuantizedLinear,
    cpu_packed_linear_supported,
    gemv_kernel,
    linear,
    quantize_linear,
)
from sgl_lite.runtime.layers.quantization.w8a8 import W8A16Int8, w8a8_kernel_available  # noqa: E402

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down [N, K]
ROWS = [1, 2, 4, 8, 16, 32, 64, 128]
ATTENTION = [(1, 480), (8, 480), (8, 2000), (32, 480)]  # (requests, context)
HEAD = (49152, 576)  # SmolLM2-135M's LM head [vocab, hidden]


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_dtypes() -> list[torch.dtype]:
    """The dtypes a small-row kernel serves on this CPU (bf16 on AVX512-BF16; bf16 and float32 on AVX2)."""
    return [d for d in (torch.bfloat16, torch.float32) if gemv_kernel(torch.empty(16, 2, dtype=d)) is not None]


def time_forms(weights: list[list[torch.Tensor]], forms: dict[str, list[list[object]]], rows: int, repeats: int,
               g: torch.Generator) -> dict[str, float]:
    """Seconds of one pass over every layer's matmuls at `rows` rows, per named set of forms, interleaved."""
    dtype = weights[0][0].dtype
    x = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {k for _, k in SHAPES}}
    times = {}
    for name, packed_layers in forms.items():
        def step(packed_layers=packed_layers) -> None:
            for layer, packed in zip(weights, packed_layers):
                for w, form in zip(layer, packed):
                    linear(x[w.shape[1]], w, None, form)
        times[name] = best_seconds(step, repeats)
    return times


def bench_matmuls(repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for dtype in matmul_dtypes():
        weights = [[(torch.randn(shape, generator=g) * 0.05).to(dtype) for shape in SHAPES] for _ in range(LAYERS)]
        kernel = gemv_kernel(weights[0][0])
        gemv = [[GemvLinear.pack(w, None) for w in layer] for layer in weights]
        # the path before the kernel: oneDNN's packed bf16 matmul where it exists, else torch's F.linear
        onednn = cpu_packed_linear_supported(dtype, torch.device("cpu"))
        baseline_name = "oneDNN packed" if onednn else "F.linear"
        baseline = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) if onednn else None for w in layer] for layer in weights]
        total_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
        for rows in tqdm(ROWS, desc=f"matmuls {dtype}"):
            times = time_forms(weights, {"kernel": gemv, "baseline": baseline}, rows, repeats, g)
            rows_out.append({"dtype": str(dtype).removeprefix("torch."), "kernel": kernel, "baseline": baseline_name,
                             "rows": rows, "kernel_ms": times["kernel"] * 1e3, "baseline_ms": times["baseline"] * 1e3,
                             "kernel_GBps": total_bytes / times["kernel"] / 1e9, "speedup": times["baseline"] / times["kernel"]})
    return rows_out


def bf16_layers_every_call(g: torch.Generator) -> tuple[list[list[torch.Tensor]], list[list[GemvLinear]]]:
    """30 layers of random bf16 weights and their small-row kernel forms, made to take every call (the
    baseline of the quantized kernels, which do)."""
    weights = [[(torch.randn(shape, generator=g) * 0.05).bfloat16() for shape in SHAPES] for _ in range(LAYERS)]
    dense = [[GemvLinear.pack(w, None) for w in layer] for layer in weights]
    for layer in dense:
        for form in layer:
            form.max_rows = None
    return weights, dense


def bench_int4(repeats: int) -> list[dict]:
    """The int4 kernel against the bf16 small-row kernel, both forced to take every call."""
    if gemv_kernel(torch.empty(16, 2, dtype=torch.bfloat16)) is None:
        return []
    g = torch.Generator().manual_seed(2)
    weights, dense = bf16_layers_every_call(g)
    int4 = [[quantize_linear("w4a16_int4", w, None) for w in layer] for layer in weights]
    for layer in int4:
        for form in layer:
            form.max_rows = max(ROWS)
    kernel = type(int4[0][0].quantized).__name__
    total_bytes = sum(form.quantized.nbytes for layer in int4 for form in layer)
    rows_out = []
    for rows in tqdm(ROWS, desc="matmuls int4"):
        times = time_forms(weights, {"kernel": int4, "baseline": dense}, rows, repeats, g)
        rows_out.append({"dtype": "int4", "kernel": kernel, "baseline": f"bf16 {gemv_kernel(weights[0][0])}", "rows": rows,
                         "kernel_ms": times["kernel"] * 1e3, "baseline_ms": times["baseline"] * 1e3,
                         "kernel_GBps": total_bytes / times["kernel"] / 1e9, "speedup": times["baseline"] / times["kernel"]})
    return rows_out


def bench_w8a8(repeats: int) -> list[dict]:
    """`--quantization w8a8_int8`'s kernel against the bf16 small-row kernel on the same 30 layers, both taking
    every call; then its LM head (int8 x 16-bit activations) against the bf16 head, over 4 copies of the head
    so that they stream from memory as in a step."""
    if gemv_kernel(torch.empty(16, 2, dtype=torch.bfloat16)) is None or not w8a8_kernel_available():
        return []
    g = torch.Generator().manual_seed(3)
    weights, dense = bf16_layers_every_call(g)
    w8a8 = [[quantize_linear("w8a8_int8", w, None) for w in layer] for layer in weights]
    total_bytes = sum(form.quantized.nbytes for layer in w8a8 for form in layer)
    heads = [(torch.randn(HEAD, generator=g) * 0.05).bfloat16() for _ in range(4)]
    head_forms = {"kernel": [QuantizedLinear(W8A16Int8(h), None, None) for h in heads],
                  "baseline": [GemvLinear.pack(h, None) for h in heads]}
    rows_out = []
    for rows in tqdm(ROWS, desc="matmuls w8a8"):
        times = time_forms(weights, {"kernel": w8a8, "baseline": dense}, rows, repeats, g)
        rows_out.append({"dtype": "int8 (w8a8)", "kernel": "w8a8_gemm", "baseline": "bf16 bf16_gemv", "rows": rows,
                         "kernel_ms": times["kernel"] * 1e3, "baseline_ms": times["baseline"] * 1e3,
                         "kernel_GBps": total_bytes / times["kernel"] / 1e9, "speedup": times["baseline"] / times["kernel"]})
        x = torch.randn(rows, HEAD[1], generator=g).bfloat16()
        head = {name: best_seconds(lambda forms=forms: [f(x, h, None) for f, h in zip(forms, heads)], repeats) / len(heads)
                for name, forms in head_forms.items()}
        head_bytes = head_forms["kernel"][0].quantized.nbytes
        rows_out.append({"dtype": "int8 x 16-bit (w8a8's LM head)", "kernel": "w8a16_gemm", "baseline": "bf16 bf16_gemv",
                         "rows": rows, "kernel_ms": head["kernel"] * 1e3, "baseline_ms": head["baseline"] * 1e3,
                         "kernel_GBps": head_bytes / head["kernel"] / 1e9, "speedup": head["baseline"] / head["kernel"]})
    return rows_out


def read_bandwidth(repeats: int) -> float:
    x = torch.ones(128 << 20)
    return x.numel() * 4 / best_seconds(x.sum, repeats)


def bench_attention(repeats: int) -> list[dict]:
    op = ops.paged_decode_attention
    g = torch.Generator().manual_seed(1)
    slots = 20000
    pools = [(torch.randn(slots, 3, 64, generator=g).bfloat16(), torch.randn(slots, 3, 64, generator=g).bfloat16()) for _ in range(LAYERS)]
    chosen = torch.ops.sgl_lite.bf16_gemv_arithmetic()
    out = []
    for requests, context in tqdm(ATTENTION, desc="attention"):
        q = torch.randn(requests, 9, 64, generator=g).bfloat16()
        starts = torch.randperm(slots // (context + 8), generator=g)[:requests] * (context + 8) + 1
        indices = torch.cat([torch.arange(s, s + context) for s in starts.tolist()])
        indptr = torch.arange(0, requests * context + 1, context, dtype=torch.int32)
        def layers() -> None:
            for k, v in pools:
                op(q, k, v, indptr, indices, 0.125)

        seconds = best_seconds(layers, repeats) / LAYERS
        kv_bytes = requests * context * 3 * 64 * 2 * 2
        row = {"requests": requests, "context": context, "us_per_layer": seconds * 1e6, "kv_GBps": kv_bytes / seconds / 1e9,
               "arithmetic": chosen, "other_arithmetic": None, "other_us_per_layer": None}
        if chosen != "none":  # bf16 on AVX512-BF16: the kernel follows bf16_gemv's probe; time the arithmetic it did not pick
            row["other_arithmetic"] = other = "fma" if chosen == "dpbf16" else "dpbf16"
            with bf16_arithmetic(other):
                row["other_us_per_layer"] = best_seconds(layers, repeats) / LAYERS * 1e6
        out.append(row)
    return out


VERIFY_CONTEXTS = [150, 500, 2000]
VERIFY_QUERIES = [1, 5, 9]  # a verification row's queries: the last token, then 0, 4 or 8 draft tokens


def bench_verify_attention(repeats: int) -> list[dict]:
    """Verification rows as the runtime runs them (one kernel row of 1 + k queries, qo_indptr), against
    the same queries as separate decode rows (the baseline: how rows ran before they shared their reads)."""
    op = ops.paged_decode_attention
    g = torch.Generator().manual_seed(2)
    out = []
    for context in tqdm(VERIFY_CONTEXTS, desc="verification rows"):
        slots = context + max(VERIFY_QUERIES)
        pools = [(torch.randn(slots, 3, 64, generator=g).bfloat16(), torch.randn(slots, 3, 64, generator=g).bfloat16()) for _ in range(LAYERS)]
        row: dict = {"context": context}
        for queries in VERIFY_QUERIES:
            q = torch.randn(queries, 9, 64, generator=g).bfloat16()
            length = context + queries - 1  # query j sees context + j keys
            one_row = (torch.tensor([0, length], dtype=torch.int32), torch.arange(length), 0.125,
                       torch.tensor([0, queries], dtype=torch.int32))
            lengths = [context + j for j in range(queries)]
            separate = (torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32),
                        torch.cat([torch.arange(n) for n in lengths]), 0.125)
            for name, args in (("queries", one_row), ("separate", separate)):
                seconds = best_seconds(lambda args=args: [op(q, k, v, *args) for k, v in pools], repeats) / LAYERS
                row[f"us_{queries}_{name}"] = seconds * 1e6
        row["us_per_draft_query"] = (row[f"us_{VERIFY_QUERIES[-1]}_queries"] - row["us_1_queries"]) / (VERIFY_QUERIES[-1] - 1)
        out.append(row)
    return out


def bench_activation(repeats: int) -> list[dict]:
    from sgl_lite.runtime.layers.activation import silu_and_mul

    out = []
    for rows in (1, 8, 80, 560):
        inputs = [torch.randn(rows, 2 * 1536).bfloat16() for _ in range(LAYERS)]
        forms = {"op": lambda: [silu_and_mul(x) for x in inputs],
                 "torch": lambda: [torch.nn.functional.silu(x[:, :1536]) * x[:, 1536:] for x in inputs]}
        times = {name: best_seconds(fn, repeats) / LAYERS for name, fn in forms.items()}
        out.append({"rows": rows, "op_us": times["op"] * 1e6, "torch_us": times["torch"] * 1e6, "speedup": times["torch"] / times["op"]})
    return out


def bench_fused_layer(repeats: int) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from runner_bench import RunnerBench

    from sgl_lite.runtime.model_executor.model_runner import ModelRunner
    from sgl_lite.runtime.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(model_path="smollm2-135m", disable_adaptive_threads=True))
    bench = RunnerBench(runner)
    fused = runner.attn.decode_kernel_inputs
    rng = random.Random(0)
    out = []
    for batch in tqdm((1, 8), desc="decode layer"):
        reqs = bench._reqs([[rng.randrange(1000, 40000) for _ in range(480)] for _ in range(batch)])
        bench._step(reqs, [480] * batch)
        times: dict[str, float] = {}
        for _ in range(repeats):  # interleaved, 8 steps each
            for name, inputs in (("one op per layer", fused), ("op by op", lambda kv_pool: None)):
                runner.attn.decode_kernel_inputs = inputs
                start = time.perf_counter()
                for _ in range(8):
                    bench._step(reqs, [1] * batch)
                times[name] = min(times.get(name, float("inf")), (time.perf_counter() - start) / 8)
        runner.attn.decode_kernel_inputs = fused
        bench._release(reqs)
        out.append({"batch": batch, **{f"{n} ms": t * 1e3 for n, t in times.items()},
                    "speedup": times["op by op"] / times["one op per layer"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=artifact_path("bench_decode_kernels.json"))
    args = parser.parse_args()
    if not matmul_dtypes():
        raise SystemExit("no small-row matmul kernel on this machine (it needs AVX512-BF16 or AVX2 + FMA): nothing to compare")
    matmuls = bench_matmuls(args.repeats) + bench_int4(args.repeats) + bench_w8a8(args.repeats)
    bandwidth = read_bandwidth(args.repeats)
    attention = bench_attention(args.repeats)
    verify = bench_verify_attention(args.repeats)
    activation = bench_activation(args.repeats)
    layer = bench_fused_layer(args.repeats)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {torch.get_num_threads()} threads, best of {args.repeats}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s\n")
    print("| dtype | rows | kernel | kernel ms (30 layers) | baseline | baseline ms | speedup | kernel weight GB/s |\n"
          "|---|---:|---|---:|---|---:|---:|---:|")
    for r in matmuls:
        print(f"| {r['dtype']} | {r['rows']} | {r['kernel']} | {r['kernel_ms']:.2f} | {r['baseline']} | {r['baseline_ms']:.2f} "
              f"| {r['speedup']:.2f}x | {r['kernel_GBps']:.1f} |")
    print("\n| requests x context | decode attention us per layer | K/V GB/s | arithmetic | the other one, us | chosen vs other |"
          "\n|---|---:|---:|---|---:|---:|")
    for r in attention:
        other = (f"{r['other_arithmetic']}: {r['other_us_per_layer']:.0f} | {r['other_us_per_layer'] / r['us_per_layer']:.2f}x"
                 if r["other_us_per_layer"] else "- | -")
        print(f"| {r['requests']} x {r['context']} | {r['us_per_layer']:.0f} | {r['kv_GBps']:.1f} | {r['arithmetic']} | {other} |")
    last = VERIFY_QUERIES[-1]
    print("\n| context | verification row, us per layer: " + " | ".join(f"{n} queries" for n in VERIFY_QUERIES)
          + f" | per draft query | {last} queries as separate rows | row vs separate |\n|---:|" + "---:|" * (len(VERIFY_QUERIES) + 3))
    for r in verify:
        print(f"| {r['context']} | " + " | ".join(f"{r[f'us_{n}_queries']:.0f}" for n in VERIFY_QUERIES)
              + f" | {r['us_per_draft_query']:.1f} | {r[f'us_{last}_separate']:.0f} | {r[f'us_{last}_separate'] / r[f'us_{last}_queries']:.2f}x |")
    print("\n| rows | silu_and_mul op, us per layer | torch's silu, mul (us) | speedup |\n|---:|---:|---:|---:|")
    for r in activation:
        print(f"| {r['rows']} | {r['op_us']:.1f} | {r['torch_us']:.1f} | {r['speedup']:.2f}x |")
    print("\n| batch | decode step, one op per layer (ms) | op by op (ms) | speedup |\n|---:|---:|---:|---:|")
    for r in layer:
        print(f"| {r['batch']} | {r['one op per layer ms']:.2f} | {r['op by op ms']:.2f} | {r['speedup']:.2f}x |")
    out = output_file(args.out)
    out.write_text(json.dumps({"time": time.time(), "read_bandwidth_GBps": bandwidth / 1e9, "matmuls": matmuls,
                               "attention": attention, "verification_rows": verify, "activation": activation,
                               "decode_layer": layer}, indent=2))
    print(f"\nwrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for dtype in sorted({r["dtype"] for r in matmuls if "LM head" not in r["dtype"]}):  # the head is one matmul, not 30 layers
        mine = [r for r in matmuls if r["dtype"] == dtype]
        for key in ("kernel", "baseline"):
            ax.plot([r["rows"] for r in mine], [r[f"{key}_ms"] for r in mine], marker="o", label=f"{dtype} {mine[0][key]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows")
    ax.set_ylabel("ms for 30 layers of matmuls")
    ax.legend()
    save_png(fig, out)


if __name__ == "__main__":
    main()
