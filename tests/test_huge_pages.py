"""Weights and the KV pool are advised onto 2 MiB pages where Linux allows it, without changing a value."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sgl_lite.runtime.model_executor.cpu_host.huge_pages import HUGE_PAGE, advise_huge_pages, tensors_of

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                                reason="no transparent huge pages here")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps): 'hg' marks MADV_HUGEPAGE."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_written_tensor_keeps_its_values_and_its_whole_huge_pages_are_advised():
    x = torch.randn(4 * HUGE_PAGE // 4)  # 8 MiB of float32: at least three whole 2 MiB pages inside
    before = x.clone()
    advised = advise_huge_pages([x, x[10:]], written=True)  # the same storage twice counts once
    assert advised >= 3 * HUGE_PAGE and advised % HUGE_PAGE == 0 and advised <= x.numel() * 4
    assert torch.equal(x, before)
    inside = (x.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    assert "hg" in _vm_flags(inside)


def test_a_fresh_pool_is_advised_and_small_tensors_are_left_alone():
    pool = torch.empty(6 * HUGE_PAGE, dtype=torch.uint8)
    assert advise_huge_pages([pool], written=False) >= 4 * HUGE_PAGE
    pool.fill_(7)  # its first writes fault in huge pages; the values are what was written
    assert int(pool.min()) == int(pool.max()) == 7
    assert advise_huge_pages([torch.ones(1000)], written=True) == 0  # no whole 2 MiB page inside


def test_tensors_of_a_model_reach_its_parameters_and_the_packed_forms_of_its_layers():
    class Packed:  # a packed weight form, as sgl_lite's linear layers hold them: a plain attribute
        __module__ = "sgl_lite.test"

        def __init__(self) -> None:
            self.packed = torch.zeros(3)

    layer = torch.nn.Linear(4, 4)
    layer.forms = {"gate_up": Packed()}
    model = torch.nn.Sequential(layer)
    found = {t.data_ptr() for t in tensors_of(model)}
    assert {layer.weight.data_ptr(), layer.bias.data_ptr(), layer.forms["gate_up"].packed.data_ptr()} <= found


def test_opaque_tensors_are_skipped():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN here")
    packed = torch.randn(1024, 1024).to_mkldnn()  # no storage: oneDNN's packed weights are like this
    assert advise_huge_pages([packed], written=True) == 0
