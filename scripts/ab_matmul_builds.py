"""A small-row matmul kernel at two versions of the code, timed in one process, interleaved.

Across processes a shared host's speeds move (where a run's memory lands, what else runs) by more than
many kernel changes move them: timing each version in a process of its own with bench_decode_kernels.py
can show no difference where there is one, or one where there is none. This builds the kernel's source file
(`kernels/csrc/<folder>/<kernel>.cpp`, with the headers of its version) as it is at git revision --base and as it
is in the working tree, each as a library of its own name, packs the layers of random weights of --shape
once (30 of SmolLM2-135M's, or 24 of a 1.7B Llama's: ~1 GB in 4 bits), checks that both builds give the
same outputs, and times a pass over every layer's matmuls (qkv, o, gate_up, down: the weights stream from
memory, as in a decode step) at each row count, the two builds alternating (each first in every other
round), best of --repeats per round. Prints a table and writes JSON: the baseline is the --base build,
measured in the same run.

Usage: python scripts/ab_matmul_builds.py --kernel bf16_gemv|w8a8_gemm|w4a8_gemm [--base HEAD] [--rows 1,4,8,32]
       [--shape 135m|1.7b] [--rounds 3] [--repeats 5] [--out artifacts/ab_matmul_builds.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from bench_decode_kernels import LAYERS, SHAPES, best_seconds  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.runtime.kernels.loader import CSRC, HEADERS, SOURCES, load_cpu_ops  # noqa: E402
from sgl_lite.runtime.layers.linear import GemvLinear  # noqa: E402
from sgl_lite.runtime.layers.quantization.w4a8 import W4A8Int4  # noqa: E402
from sgl_lite.runtime.layers.quantization.w8a8 import W8A8Int8  # noqa: E402
from sgl_lite.runtime.layers.quantization.weight_only import Int4Values  # noqa: E402

PACK = {"bf16_gemv": lambda w: GemvLinear.pack(w, None).gemv_weight, "w8a8_gemm": lambda w: W8A8Int8(w).packed,
        "w4a8_gemm": lambda w: W4A8Int4(Int4Values.quantize(w)).packed}
# --shape: (layers, each layer's matmuls [N, K]: qkv, o, gate_up, down)
MODEL_SHAPES = {"135m": (LAYERS, SHAPES), "1.7b": (24, [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)])}


def build(kernel: str, source: str, library: str, workdir: Path):
    """`source` (a csrc .cpp) built with the runtime's flags, its ops registered under `library`."""
    # its own library name, so that both builds load beside the runtime's; the one symbol the runtime's
    # library defines for the others (bf16_gemv.cpp's probe result) renamed away, and its callers given the
    # runtime's answer
    preferred = "true" if torch.ops.sgl_lite.bf16_gemv_arithmetic() == "dpbf16" else "false"
    text = source.replace("TORCH_LIBRARY_FRAGMENT(sgl_lite", f"TORCH_LIBRARY({library}").replace(
        "TORCH_LIBRARY(sgl_lite", f"TORCH_LIBRARY({library}").replace(
        "TORCH_LIBRARY_IMPL(sgl_lite", f"TORCH_LIBRARY_IMPL({library}").replace(
        "bool sgl_lite::dpbf16_preferred()", "bool unused_dpbf16_preferred()").replace(
        "sgl_lite::dpbf16_preferred()", preferred)
    path = workdir / f"{library}.cpp"
    path.write_text(text)
    cpp_extension.load(name=library, sources=[str(path)], extra_cflags=["-O3", "-fopenmp", "-march=native"],
                       extra_ldflags=["-fopenmp"], build_directory=str(workdir), is_python_module=False)
    return getattr(getattr(torch.ops, library), kernel)


def git_show(base: str, relative: str) -> str | None:
    """A file as it is at git revision `base` (None where it did not exist)."""
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{base}:{relative}"], capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else None


def csrc_at(base: str, path: Path) -> str | None:
    """csrc file `path` as it is at git revision `base`, in its folder or where revisions before the folders
    kept it (csrc/ itself); None where it did not exist."""
    shown = git_show(base, str(path.relative_to(ROOT)))
    return shown if shown is not None else git_show(base, str((CSRC / path.name).relative_to(ROOT)))


def base_and_tree(kernel: str, base: str) -> dict:
    """The op `kernel` (csrc/<folder>/<kernel>.cpp) built as it is at git revision `base` and in the working tree,
    each with the headers of its own version: {"base": op, "working tree": op}."""
    if not load_cpu_ops():
        raise SystemExit("the C++ ops do not build here (see sgl_lite.runtime.kernels.loader)")
    source_path = next(path for path in SOURCES if path.stem == kernel)
    base_source = csrc_at(base, source_path)
    if base_source is None:
        raise SystemExit(f"{source_path.relative_to(ROOT)} does not exist at {base}")
    ops = {}
    for name, library, source in (("base", "ab_base", base_source), ("working tree", "ab_tree", source_path.read_text())):
        workdir = Path(tempfile.mkdtemp(prefix=f"ab_{kernel}-"))
        try:
            for header in HEADERS:  # all in one folder: sources include them by name
                text = csrc_at(base, header) if name == "base" else None
                (workdir / header.name).write_text(text if text is not None else header.read_text())
            ops[name] = build(kernel, source, library, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return ops


def timing_cells(ms: dict[str, list[float]]) -> str:
    """A table row's cells for one case timed on both builds ({"base": [...], "working tree": [...]}, ms per
    round): each build's rounds, then base / working tree of their best rounds."""
    base, tree = ms["base"], ms["working tree"]
    return f"{', '.join(f'{v:.2f}' for v in base)} | {', '.join(f'{v:.2f}' for v in tree)} | {min(base) / min(tree):.2f}x"


def in_turn(ops: dict, round_: int) -> list:
    """The builds in the order round `round_` runs them: base first in even rounds, last in odd ones, so that
    neither always runs second (after the other has warmed the caches, or the clock)."""
    return list(ops.items()) if round_ % 2 == 0 else list(ops.items())[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=sorted(PACK), required=True)
    parser.add_argument("--base", default="HEAD", help="git revision of the baseline build")
    parser.add_argument("--rows", default="1,4,8,32")
    parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="135m",
                        help="the layers' matmul shapes: SmolLM2-135M's (30 layers) or a 1.7B Llama's (24)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=artifact_path("ab_matmul_builds.json"))
    args = parser.parse_args()
    ops = base_and_tree(args.kernel, args.base)
    g = torch.Generator().manual_seed(0)
    layers, shapes = MODEL_SHAPES[args.shape]
    packed = [[PACK[args.kernel]((torch.randn(shape, generator=g) * 0.05).bfloat16()) for shape in shapes] for _ in range(layers)]

    def seconds(op, rows: int) -> float:
        x = {k: torch.randn(rows, k, generator=g).bfloat16() for _, k in shapes}

        def one_pass() -> None:
            for layer in packed:
                for weight, (_, k) in zip(layer, shapes):
                    op(x[k], weight, None)
        return best_seconds(one_pass, args.repeats)

    rows = [int(r) for r in args.rows.split(",")]
    for r in rows:  # the same bits from both builds, or a note
        x = {k: torch.randn(r, k, generator=g).bfloat16() for _, k in shapes}
        base, tree = ([op(x[k], weight, None) for weight, (_, k) in zip(packed[0], shapes)] for op in ops.values())
        if not all(torch.equal(a, b) for a, b in zip(base, tree)):
            print(f"note: the builds' outputs differ at {r} rows")
    ms: dict[int, dict[str, list[float]]] = {r: {name: [] for name in ops} for r in rows}
    for round_ in range(args.rounds):
        for r in rows:
            for name, op in in_turn(ops, round_):
                ms[r][name].append(1e3 * seconds(op, r))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {args.kernel}: --base {args.base} against the working tree, "
          f"{args.shape} shape, {layers} layers' matmuls, ms per pass, best of {args.repeats} per round, {args.rounds} rounds interleaved\n")
    print("| rows | base | working tree | base / working tree (best rounds) |\n|---:|---|---|---:|")
    for r in rows:
        print(f"| {r} | {timing_cells(ms[r])} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"time": time.time(), "args": vars(args), "ms": {str(r): v for r, v in ms.items()}}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
