"""The C++ ops compile for every x86 class the loader can meet, not only for this machine's.

kernels/loader.py builds kernels/csrc/ with -march=native, so a suite run on an AVX512-BF16 box builds and tests
that target alone; code outside a kernel's `#if` that leans on what is inside it would break the whole
library (and with it every C++ op: the runtime falls back to torch) on an AVX2-only host, unseen here.
This compiles each source (syntax and templates, no code generation) for the other classes.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_lite.runtime.kernels.loader import SOURCE_DIRS, SOURCES

TARGETS = {
    "x86-64": "no AVX: the loader's portable retry",
    "haswell": "AVX2 + FMA, as the AVX2-only EPYC hosts",
    "skylake-avx512": "AVX-512 without BF16 or VNNI",
}


@pytest.mark.parametrize("march", sorted(TARGETS))
def test_sources_compile_for_target(march: str) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 targets")
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ here (the loader needs it too)")
    from torch.utils.cpp_extension import include_paths

    flags = ["-std=c++17", "-fsyntax-only", "-fopenmp", f"-march={march}", f"-I{sysconfig.get_paths()['include']}",
             *(f"-I{path}" for path in include_paths()), *(f"-I{folder}" for folder in SOURCE_DIRS)]

    def compile_one(source):
        return subprocess.run([compiler, *flags, str(source)], capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(compile_one, SOURCES))
    failures = {source.name: result.stderr[-3000:] for source, result in zip(SOURCES, results) if result.returncode != 0}
    assert not failures, f"{march} ({TARGETS[march]}): {failures}"
