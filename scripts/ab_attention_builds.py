"""The paged decode attention kernel at two versions of the code, timed in one process, interleaved.

As scripts/ab_matmul_builds.py does for the matmuls (a shared host's process-to-process spread hides
small kernel changes): builds `kernels/csrc/attention/paged_decode_attention.cpp` with its headers as they are
at git revision --base and as they are in the working tree, each as a library of its own name, checks that
both give the same outputs, and times a decode step's layers of attention (--shape 135m: SmolLM2-135M's 30
layers of 9 query / 3 KV heads of 64; --shape 1.7b: 24 layers of 32 / 32, a 1.7B Llama's), bf16 (--dtype
float32: the kernel's FMA path), each layer with its own K/V pool, so that K/V stream from memory as in a
served step, per case, the two builds alternating (each first in every other round), best of --repeats per
round:

- b8 agent: 8 rows of 330-560 tokens whose first 280 slots are shared (the multi-turn agent's system
  prompt, cached once in the radix tree), the rest each row's own; the same rows each verifying 4
  n-gram draft tokens (5 queries a row); and 32 such rows;
- b8 / b32 x 500: rows of 500 tokens, every slot its own;
- b1 x 500 and b1 x 4000: one row (the second, an agent's long context);
- b8 x 460 from cache: every layer reading the same pool (2.8 MB at 135m: from L2/L3, mostly the arithmetic).

Prints a table and writes JSON: the baseline is the --base build, measured in the same run.

Usage: python scripts/ab_attention_builds.py [--base HEAD] [--shape 135m|1.7b] [--dtype bf16|float32] [--rounds 3]
       [--repeats 7] [--out artifacts/ab_attention_builds.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from ab_matmul_builds import base_and_tree, in_turn, timing_cells  # noqa: E402
from bench_decode_kernels import LAYERS, best_seconds  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402

# --shape: (query heads, KV heads, head size, layers)
SHAPES = {"135m": (9, 3, 64, LAYERS), "1.7b": (32, 32, 64, 24)}
DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


def make_case(lens: list[int], shared: int, pools: int, g: torch.Generator, queries: int = 1,
              shape: tuple[int, int, int, int] = SHAPES["135m"], dtype: torch.dtype = torch.bfloat16) -> tuple:
    """q, per-layer K/V pools and the rows' kv_indptr / kv_indices / qo_indptr (None: one query a row, else
    `queries`, a verification row's): each row's first `shared` slots are the same slots, the rest its own."""
    hq, hkv, dim, layers = shape
    slots = shared + sum(n - min(shared, n) for n in lens)
    k = [torch.randn(slots, hkv, dim, generator=g).to(dtype) for _ in range(pools)]
    v = [torch.randn(slots, hkv, dim, generator=g).to(dtype) for _ in range(pools)]
    q = torch.randn(len(lens) * queries, hq, dim, generator=g).to(dtype)
    indices, indptr, free = [], [0], shared
    for n in lens:
        own = n - min(shared, n)
        indices += list(range(min(shared, n))) + list(range(free, free + own))
        free += own
        indptr.append(len(indices))
    qo = None if queries == 1 else torch.arange(0, len(lens) * queries + 1, queries, dtype=torch.int32)
    return (q, [k[i % pools] for i in range(layers)], [v[i % pools] for i in range(layers)],
            torch.tensor(indptr, dtype=torch.int32), torch.tensor(indices, dtype=torch.int64), qo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision of the baseline build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="135m",
                        help="the model's attention shape: SmolLM2-135M's (9 / 3 heads, 30 layers) or a 1.7B's (32 / 32, 24 layers)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="queries and K/V: bf16 (VDPBF16PS pairs where the CPU prefers them) or float32 (the FMA path)")
    parser.add_argument("--out", default=artifact_path("ab_attention_builds.json"))
    args = parser.parse_args()
    ops = base_and_tree("paged_decode_attention", args.base)
    g = torch.Generator().manual_seed(0)
    shape = SHAPES[args.shape]
    hq, hkv, dim, layers = shape
    agent = [330, 380, 420, 450, 480, 520, 540, 560]
    case_of = functools.partial(make_case, g=g, shape=shape, dtype=DTYPES[args.dtype])
    cases = {
        "b8 agent: 330-560 tokens, 280 shared": case_of(agent, 280, layers),
        "b8 agent, each verifying 4 drafts": case_of(agent, 280, layers, queries=5),
        "b32 agent: 330-560 tokens, 280 shared": case_of(agent * 4, 280, layers),
        "b8 x 500": case_of([500] * 8, 0, layers),
        "b32 x 500": case_of([500] * 32, 0, layers),
        "b1 x 500": case_of([500], 0, layers),
        "b1 x 4000": case_of([4000], 0, layers),
        "b8 x 460 from cache": case_of([460] * 8, 0, 1),
    }
    scale = dim ** -0.5
    for case, (q, k, v, indptr, indices, qo) in cases.items():
        outs = [op(q, k[0], v[0], indptr, indices, scale, qo) for op in ops.values()]
        if not torch.equal(outs[0], outs[1]):
            print(f"note: the builds' outputs differ on {case} (max |diff| {(outs[0].float() - outs[1].float()).abs().max():.3g})")
    ms: dict[str, dict[str, list[float]]] = {case: {name: [] for name in ops} for case in cases}
    for round_ in range(args.rounds):
        for case, (q, k, v, indptr, indices, qo) in cases.items():
            for name, op in in_turn(ops, round_):
                def one_step() -> None:
                    for layer in range(layers):
                        op(q, k[layer], v[layer], indptr, indices, scale, qo)
                ms[case][name].append(1e3 * best_seconds(one_step, args.repeats))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, paged_decode_attention: --base {args.base} against the working tree, "
          f"{args.shape} shape ({hq} / {hkv} heads of {dim}), {args.dtype}, {layers} layers, ms per step, best of {args.repeats} per round, {args.rounds} rounds interleaved\n")
    print("| case | base | working tree | base / working tree (best rounds) |\n|---|---|---|---:|")
    for case, by in ms.items():
        print(f"| {case} | {timing_cells(by)} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"time": time.time(), "args": vars(args), "ms": ms}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
