"""Builds and loads sgl_lite's C++ CPU ops (csrc/: paged decode attention, RMSNorm, the small-row matmuls (AVX512-BF16, AVX2),
a decode step's whole decoder layer), once per machine.

Built with torch's extension tooling (g++ and ninja) on first use and cached as one shared library under
$SGL_LITE_CACHE/kernels (default ~/.cache/sgl_lite/kernels, the same root as the model cache), named by a
hash of the source, torch's version, the compiler flags and this CPU's identity: the build targets the
host CPU (-march=native), so a cache folder shared between different machines must never hand one
machine's build to another. Each build runs in a private temporary folder and is published with an atomic
rename, so processes that start together neither wait on a lock another one may never release nor load a
half-written file. `scripts/install.sh` prebuilds it: `python -m sgl_lite.runtime.layers.cpu_ops`.

All sources go into one library under the `sgl_lite` op namespace. When the build fails (no compiler, an
old one), `load_cpu_ops` logs one line and returns False, and every caller keeps its torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.h")))  # hashed with the sources
# -fopenmp: at::parallel_for is inline OpenMP code; the library links libgomp.so.1, which resolves to the
# copy torch already loaded, so the process keeps one OpenMP thread pool.
_COMMON_FLAGS = ["-O3", "-fopenmp"]
# Tried in order: tuned for this CPU first, then portable x86-64 / aarch64 code if the compiler refuses.
_TARGET_FLAGS = (["-march=native"], [])


def _cpu_identity() -> str:
    """What decides which instructions a -march=native build may use: the model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _cache_dir() -> Path:
    # Same rule as model_executor/loader.py's cache_root (layers may not import the executor).
    root = Path(os.environ.get("SGL_LITE_CACHE") or Path.home() / ".cache" / "sgl_lite").expanduser()
    return root / "kernels"


def _library_name(flags: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES + HEADERS), torch.__version__.encode(), " ".join(flags).encode(),
                 _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"sgl_lite_cpu_ops_{digest.hexdigest()[:16]}"


def _build(name: str, flags: list[str], target: Path) -> None:
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=target.parent))
    try:
        cpp_extension.load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(workdir), is_python_module=False, verbose=False)
        os.replace(workdir / f"{name}.so", target)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@functools.cache
def load_cpu_ops() -> bool:
    """Whether the ops are loaded in this process (building them first if this machine has no build yet)."""
    errors = []
    for target_flags in _TARGET_FLAGS:
        flags = _COMMON_FLAGS + target_flags
        name = _library_name(flags)
        library = _cache_dir() / f"{name}.so"
        try:
            if library.exists():
                torch.ops.load_library(str(library))
                return True
            start = time.perf_counter()
            _build(name, flags, library)  # also loads it into this process
            logger.info("built the CPU ops (decode attention, RMSNorm, small-row matmuls) in %.0f s: %s", time.perf_counter() - start, library)
            return True
        except Exception as e:  # noqa: BLE001 - any build or load failure means: use the torch path
            errors.append(f"{' '.join(flags)}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")
    logger.warning("the CPU ops (decode attention, RMSNorm, small-row matmuls) could not be built, using the torch path (%s)", "; ".join(errors))
    return False


def load_paged_decode_op() -> Callable[..., torch.Tensor] | None:
    """The op `paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale, qo_indptr=None)`, or None
    if it cannot be built."""
    return torch.ops.sgl_lite.paged_decode_attention if load_cpu_ops() else None


@contextmanager
def bf16_arithmetic(name: str) -> Iterator[None]:
    """The bf16 kernels in `name` ("fma" or "dpbf16") inside the block, whatever bf16_gemv's probe chose
    (benchmarks and tests time or check the arithmetic it did not pick); the earlier choice after it."""
    ops = torch.ops.sgl_lite
    before = ops.bf16_gemv_arithmetic()
    ops.set_bf16_gemv_arithmetic(name)
    try:
        yield
    finally:
        ops.set_bf16_gemv_arithmetic(before)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if load_cpu_ops() else 1)
