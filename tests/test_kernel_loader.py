"""The C++ ops' loader (runtime/kernels/loader.py): a build that fails falls back to the torch path with a line
that says so, and a source that does not compile disables only its own ops (and those linking against it)."""

from __future__ import annotations

import logging

import torch

from sgl_lite.runtime.kernels import loader


def test_build_failure_falls_back_with_a_line_that_says_so(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(loader, "SOURCES", (broken,))
    monkeypatch.setenv("SGL_LITE_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert loader.load_cpu_ops.__wrapped__() is False
    warnings = [r.getMessage() for r in caplog.records if r.name == loader.logger.name and r.levelno >= logging.WARNING]
    assert any("broken did not compile" in w for w in warnings)
    assert "using the torch path" in warnings[-1]
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


def test_a_source_that_does_not_compile_disables_only_its_own_ops(tmp_path, monkeypatch, caplog):
    """One broken source among good ones: the library is built from the rest, whose ops load, and the log
    names the one left out. A source linking against the broken one is left out with it."""
    good = tmp_path / "probe_good.cpp"
    good.write_text('#include <torch/library.h>\n#include <ATen/ATen.h>\n'
                    'at::Tensor probe_twice(const at::Tensor& x) { return x * 2; }\n'
                    'TORCH_LIBRARY_FRAGMENT(sgl_lite, m) { m.def("probe_twice(Tensor x) -> Tensor", &probe_twice); }\n')
    broken = tmp_path / "probe_broken.cpp"
    broken.write_text("this is not C++\n")
    dependent = tmp_path / "probe_dependent.cpp"
    dependent.write_text("int probe_dependent() { return 1; }\n")
    monkeypatch.setenv("SGL_LITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(loader.SOURCE_NEEDS, "probe_dependent", {"probe_broken"})
    with caplog.at_level(logging.WARNING):
        built = loader._load_or_build((broken, dependent, good), ["-O1"])
    assert built == (good,)
    assert any("probe_broken did not compile" in r.getMessage() for r in caplog.records)
    assert torch.equal(torch.ops.sgl_lite.probe_twice(torch.arange(3)), torch.arange(3) * 2)
