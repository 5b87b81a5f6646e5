"""Builds and loads sgl_lite's C++ CPU ops (csrc/), once per machine, and says which ops this process has.

Built with torch's extension tooling (g++ and ninja) on first use and cached as one shared library under
$SGL_LITE_CACHE/kernels (default ~/.cache/sgl_lite/kernels, the same root as the model cache), named by a
hash of the sources it holds, torch's version, the compiler flags and this CPU's identity: the build targets
the host CPU (-march=native), so a cache folder shared between different machines must never hand one
machine's build to another. Each build runs in a private temporary folder and is published with an atomic
rename, so processes that start together neither wait on a lock another one may never release nor load a
half-written file. `scripts/install.sh` prebuilds it: `python -m sgl_lite.runtime.kernels.loader`.

Every source registers its ops as a fragment of the `sgl_lite` op namespace. A source that does not compile
disables its own ops (and those of the sources that link against it, SOURCE_NEEDS), not the others: the
build is retried without it, and the log names what was left out. Only when nothing builds does
`load_cpu_ops` return False; every caller asks `has_op` / `runs_here` for the op it wants and keeps its
torch path otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# A folder per kind of op (attention, matmul, layer: the decode layer and its elementwise ops) and one for
# what they share (common: vector helpers, the threads' ids, the disk tier's row copies); sources include
# headers by name, from any folder.
SOURCE_DIRS = tuple(sorted(path for path in CSRC.iterdir() if path.is_dir()))
SOURCES = tuple(sorted(CSRC.glob("*/*.cpp"), key=lambda path: path.name))
HEADERS = tuple(sorted(CSRC.glob("*/*.h"), key=lambda path: path.name))  # hashed with the sources
# Sources that call a function another source defines (not an op: ops are found through the dispatcher):
# they cannot link without it. bf16_gemv.cpp defines dpbf16_preferred() (bf16_arithmetic.h).
SOURCE_NEEDS = {"extend_attention": {"bf16_gemv"}, "paged_decode_attention": {"bf16_gemv"}}
# Ops that call other ops through the dispatcher: usable only where those were built too.
OP_NEEDS = {"decode_layer": {"rms_norm", "add_rms_norm", "paged_decode_attention", "silu_and_mul"}}
# -fopenmp: at::parallel_for is inline OpenMP code; the library links libgomp.so.1, which resolves to the
# copy torch already loaded, so the process keeps one OpenMP thread pool.
_COMMON_FLAGS = ["-O3", "-fopenmp"]
# Tried in order: tuned for this CPU first, then portable x86-64 / aarch64 code if the compiler refuses.
_TARGET_FLAGS = (["-march=native"], [])
_FAILED_OBJECT = re.compile(r"FAILED: (?:\[[^\]]*\]\s*)?(\S+?)\.o\b")  # ninja's line for a source that did not compile


def _cpu_identity() -> str:
    """What decides which instructions a -march=native build may use: the model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _cache_dir() -> Path:
    # Same rule as model_executor/loader.py's cache_root (kernels may not import the executor).
    root = Path(os.environ.get("SGL_LITE_CACHE") or Path.home() / ".cache" / "sgl_lite").expanduser()
    return root / "kernels"


def _library_name(sources: tuple[Path, ...], flags: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in sources + HEADERS), torch.__version__.encode(), " ".join(flags).encode(),
                 _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"sgl_lite_cpu_ops_{digest.hexdigest()[:16]}"


def _build(name: str, sources: tuple[Path, ...], flags: list[str], target: Path) -> None:
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=target.parent))
    try:
        cpp_extension.load(name=name, sources=[str(source) for source in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           extra_include_paths=[str(folder) for folder in SOURCE_DIRS], build_directory=str(workdir),
                           is_python_module=False, verbose=False)
        os.replace(workdir / f"{name}.so", target)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _without(sources: tuple[Path, ...], broken: set[str]) -> tuple[Path, ...]:
    """`sources` less the broken ones and, transitively, every source that links against one of them."""
    dropped = set(broken)
    while True:
        more = {s.stem for s in sources if s.stem not in dropped and SOURCE_NEEDS.get(s.stem, set()) & dropped}
        if not more:
            return tuple(s for s in sources if s.stem not in dropped)
        dropped |= more


def _load_or_build(sources: tuple[Path, ...], flags: list[str]) -> tuple[Path, ...]:
    """Load the library of the sources that compile with `flags` (building it if needed); the sources it holds.
    Raises when none compiles."""
    while sources:
        name = _library_name(sources, flags)
        library = _cache_dir() / f"{name}.so"
        if library.exists():
            torch.ops.load_library(str(library))
            return sources
        start = time.perf_counter()
        try:
            _build(name, sources, flags, library)  # also loads it into this process
        except Exception as e:  # noqa: BLE001 - a compile error names its object file; anything else is final
            failed = set(_FAILED_OBJECT.findall(str(e))) & {s.stem for s in sources}
            if not failed:
                raise
            logger.warning("C++ ops: %s did not compile (%s); building the rest without %s", ", ".join(sorted(failed)),
                           " ".join(flags), "it" if len(failed) == 1 else "them")
            sources = _without(sources, failed)
            continue
        logger.info("built the CPU ops (%d sources) in %.0f s: %s", len(sources), time.perf_counter() - start, library)
        return sources
    raise RuntimeError("no source compiled")


@functools.cache
def load_cpu_ops() -> bool:
    """Whether any op is loaded in this process (building the library first if this machine has none yet)."""
    errors = []
    for target_flags in _TARGET_FLAGS:
        flags = _COMMON_FLAGS + target_flags
        try:
            built = _load_or_build(SOURCES, flags)
        except Exception as e:  # noqa: BLE001 - any build or load failure means: use the torch path
            errors.append(f"{' '.join(flags)}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")
            continue
        if len(built) < len(SOURCES):
            missing = sorted({s.stem for s in SOURCES} - {s.stem for s in built})
            logger.warning("C++ ops built without %s: their callers use the torch path", ", ".join(missing))
        return True
    logger.warning("the CPU ops (decode attention, RMSNorm, small-row matmuls) could not be built, using the torch path (%s)", "; ".join(errors))
    return False


def has_op(name: str) -> bool:
    """Whether op `name` of the `sgl_lite` namespace is built and loaded here (with the ops it calls)."""
    if not load_cpu_ops():
        return False
    try:
        getattr(torch.ops.sgl_lite, name)
    except (AttributeError, RuntimeError):
        return False
    return all(has_op(needed) for needed in OP_NEEDS.get(name, ()))


@functools.cache
def runs_here(name: str) -> bool:
    """Whether op `name` is built and this CPU runs it: an op with a `<name>_supported` companion (one
    compiled only for some instruction sets) asks it."""
    if not has_op(name):
        return False
    return not has_op(f"{name}_supported") or bool(getattr(torch.ops.sgl_lite, f"{name}_supported")())


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
