"""Prefill/extend attention on CPU: the C++ extend kernel and torch_native's tiled matmul path against SDPA,
same inputs, one run.

For each (prefix, new tokens, requests) shape - one long prompt from scratch, agent turns that extend a
cached conversation, a short chunk on a long context - it builds a KV pool holding the prefixes (the
default model's heads: 9 query and 3 KV heads of 64, bf16 unless --dtype float32) and times one layer's
attention for all new rows:
- kernel: `CpuKernelBackend.forward` (kernels/csrc/attention/extend_attention.cpp, the cpu_kernel backend's extend
  path where it is built);
- kernel in the other arithmetic (bf16 on AVX512-BF16 CPUs): the kernel follows bf16_gemv's probe, float32
  FMAs or VDPBF16PS pairs, whichever this core runs faster; the other one is timed too, with its ratio;
- torch: `TorchNativeBackend.forward` (the torch_native backend's extend path, and cpu_kernel's elsewhere);
- baseline: `F.scaled_dot_product_attention` per request: `is_causal` without a prefix, else the causal
  mask that the prefix offset needs; on the same gathered K/V.
Prints a markdown table (the fastest of --repeats calls in ms, since a busy neighbour only ever slows a
call down; speedups against SDPA; the largest difference from it), writes JSON and a PNG.
Usage: python scripts/bench_extend_attention.py [--dtype bfloat16] [--repeats 20] [--out artifacts/bench_extend_attention.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, save_png  # noqa: E402
from sgl_lite.runtime.kernels.loader import bf16_arithmetic  # noqa: E402
from sgl_lite.runtime.layers.attention import AttentionMetadata, TorchNativeBackend, create_backend  # noqa: E402
from sgl_lite.runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool  # noqa: E402

HQ, HKV, DIM = 9, 3, 64
SHAPES = [  # (prefix, new tokens per request, requests)
    (0, 512, 1), (0, 2048, 1), (450, 90, 8), (2000, 200, 1), (4000, 32, 4),
]


def _fastest_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def measure(prefix: int, extend: int, num_reqs: int, dtype: torch.dtype, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    context = prefix + extend
    pool = KVPool(num_layers=1, num_slots=num_reqs * context, kv_heads=HKV, head_dim=DIM, dtype=dtype)
    table = ReqToTokenPool(max_requests=num_reqs, max_context=context)
    rows = [table.alloc() for _ in range(num_reqs)]
    for i, row in enumerate(rows):
        table.table[row, :context] = torch.arange(1 + i * context, 1 + (i + 1) * context)
    pool.k[0][1:] = torch.randn(num_reqs * context, HKV, DIM, generator=g).to(dtype)
    pool.v[0][1:] = torch.randn(num_reqs * context, HKV, DIM, generator=g).to(dtype)
    new = torch.cat([table.table[row, prefix:context] for row in rows])
    q = torch.randn(num_reqs * extend, HQ, DIM, generator=g).to(dtype)
    k, v = pool.k[0][new].clone(), pool.v[0][new].clone()
    meta = AttentionMetadata.build(rows, [prefix] * num_reqs, [extend] * num_reqs, new, table)
    torch_path = TorchNativeBackend(HQ, HKV, DIM)
    torch_path.prepare(meta)
    kernel = create_backend("cpu_kernel", torch.device("cpu"), HQ, HKV, DIM)
    kernel.prepare(meta)
    if getattr(kernel, "_extend_table", None) is None:
        kernel = None  # not built here (it needs AVX-512): the torch path is cpu_kernel's extend path
    mask = torch.arange(context)[None, :] <= prefix + torch.arange(extend)[:, None]

    def sdpa() -> torch.Tensor:
        outs = []
        for i, row in enumerate(rows):
            slots = table.table[row, :context]
            keys, values = pool.k[0][slots].transpose(0, 1)[None], pool.v[0][slots].transpose(0, 1)[None]
            qr = q[i * extend : (i + 1) * extend].transpose(0, 1)[None]
            outs.append(F.scaled_dot_product_attention(qr, keys, values, attn_mask=None if prefix == 0 else mask,
                                                      is_causal=prefix == 0, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs)

    base = _fastest_ms(sdpa, repeats)
    reference = sdpa().float()
    row = {"prefix": prefix, "extend": extend, "requests": num_reqs, "sdpa_ms": base}
    for name, backend in (("torch", torch_path), ("kernel", kernel)):
        if backend is None:
            row[f"{name}_ms"] = row[f"{name}_speedup"] = row[f"{name}_max_abs_diff"] = None
            continue
        row[f"{name}_ms"] = _fastest_ms(lambda backend=backend: backend.forward(0, q, k, v, pool), repeats)
        row[f"{name}_speedup"] = base / row[f"{name}_ms"]
        row[f"{name}_max_abs_diff"] = (backend.forward(0, q, k, v, pool).float() - reference).abs().max().item()
    row["arithmetic"], row["other_arithmetic"], row["other_ms"] = _arithmetic(dtype, kernel), None, None
    if row["arithmetic"] is not None:
        other = "fma" if row["arithmetic"] == "dpbf16" else "dpbf16"
        row["other_arithmetic"] = other
        with bf16_arithmetic(other):
            row["other_ms"] = _fastest_ms(lambda: kernel.forward(0, q, k, v, pool), repeats)
    return row


def _arithmetic(dtype: torch.dtype, kernel: object | None) -> str | None:
    """The bf16 kernel's arithmetic here (`fma` or `dpbf16`), None where it has no choice."""
    if kernel is None or dtype != torch.bfloat16:
        return None
    chosen = torch.ops.sgl_lite.bf16_gemv_arithmetic()
    return None if chosen == "none" else chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=artifact_path("bench_extend_attention.json"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    results = [measure(p, e, n, dtype, args.repeats) for p, e, n in tqdm(SHAPES, desc="shapes")]
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.dtype}, {torch.get_num_threads()} threads, "
          f"{HQ} query / {HKV} KV heads of {DIM}; one layer, fastest of {args.repeats} (ms)\n")
    chosen = results[0]["arithmetic"]
    if chosen:
        print(f"the bf16 kernel runs in {chosen} here (bf16_gemv's probe); `kernel in {results[0]['other_arithmetic']}` "
              "times it in the other arithmetic\n")
    print("| prefix | new tokens | requests | SDPA (baseline) | torch path | speedup | extend kernel | speedup | "
          "kernel in the other arithmetic | chosen vs other | max abs diff from SDPA (torch / kernel) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for r in results:
        print(f"| {r['prefix']} | {r['extend']} | {r['requests']} | {r['sdpa_ms']:.2f} | {cell(r['torch_ms'], '.2f')} | "
              f"{cell(r['torch_speedup'], '.2f')}x | {cell(r['kernel_ms'], '.2f')} | {cell(r['kernel_speedup'], '.2f')}x | "
              f"{cell(r['other_ms'], '.2f')} | {cell(r['other_ms'] and r['other_ms'] / r['kernel_ms'], '.2f')}x | "
              f"{cell(r['torch_max_abs_diff'], '.3g')} / {cell(r['kernel_max_abs_diff'], '.3g')} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
                               "results": results}, indent=2))
    print(f"\nwrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['prefix']}+{r['extend']}x{r['requests']}" for r in results]
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([i - 0.27 for i in x], [r["sdpa_ms"] for r in results], 0.27, label="SDPA (baseline)")
    ax.bar(list(x), [r["torch_ms"] for r in results], 0.27, label="torch path (tiled matmuls)")
    ax.bar([i + 0.27 for i in x], [r["kernel_ms"] or 0 for r in results], 0.27, label="extend kernel")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per layer")
    ax.set_xlabel("prefix + new tokens x requests")
    ax.legend()
    save_png(fig, out)


if __name__ == "__main__":
    main()
