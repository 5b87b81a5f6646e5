"""The model's weights and the KV pool on transparent huge pages (2 MiB) where Linux offers them.

Why: a decode step reads ~100 MB of weights and each request's KV rows scattered over a pool of gigabytes,
one layer after another; on 4 KiB pages that is a page-table walk every 4 KiB, more pages than the TLB holds.
A batch-8 w8a8 decode step runs a little faster on 2 MiB pages, in every round of an in-process A/B
(`python scripts/ab_huge_pages.py`; docs/performance.md, "Weights and KV pool on 2 MiB pages").

Where THP is "madvise" (Debian's default) nothing is on huge pages unless asked:
`madvise(MADV_HUGEPAGE)` asks for a range's future faults, and `MADV_COLLAPSE` (Linux 6.1+) moves pages
already written into huge pages at once (weights are written at load, before this runs). Only the whole
2 MiB-aligned pages inside a tensor's storage are advised, so nothing outside it changes. Where either call
fails (THP "never", an older kernel, another OS) the memory stays as it was: this is a speed hint, never a
requirement.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable, Iterator

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


_MADVISE = _madvise()


def _huge_range(storage: torch.UntypedStorage) -> tuple[int, int] | None:
    """The whole 2 MiB pages inside a storage: (start, length), or None if there are none."""
    begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    start = (begin + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    length = (end - start) // HUGE_PAGE * HUGE_PAGE
    return (start, length) if length > 0 else None


def advise_huge_pages(tensors: Iterable[torch.Tensor], written: bool) -> int:
    """Ask for huge pages under each CPU tensor's storage (each storage once); `written`: its pages hold data
    already (weights), so collapse them now, else (a fresh pool) only its future faults. Returns the bytes
    advised (0 where the platform refuses)."""
    if _MADVISE is None:
        return 0
    advised, seen = 0, set()
    for tensor in tensors:
        # (oneDNN's packed weights are opaque: no storage to advise)
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        span = _huge_range(storage)
        if span is None or _MADVISE(span[0], span[1], _MADV_HUGEPAGE) != 0:
            continue
        if written:
            _MADVISE(span[0], span[1], _MADV_COLLAPSE)  # fails on kernels before 6.1: khugepaged collapses later
        advised += span[1]
    return advised


_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules"})


def tensors_of(root: object, depth: int = 4) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `root` through modules, sgl_lite objects' attributes, dicts, lists and
    tuples, up to `depth` levels below each module: a model's parameters, buffers and packed weight forms
    (which are plain attributes of sgl_lite's linear layers, not parameters)."""
    modules = root.modules() if isinstance(root, torch.nn.Module) else [root]
    for module in modules:
        yield from _walk(module, depth)


def _walk(value: object, depth: int) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth == 0:
        return
    elif isinstance(value, torch.nn.Module):  # its submodules are walked from the root
        yield from value.parameters(recurse=False)
        yield from value.buffers(recurse=False)
        for name, attribute in vars(value).items():
            if name not in _MODULE_INTERNALS:
                yield from _walk(attribute, depth - 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _walk(item, depth - 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item, depth - 1)
    elif type(value).__module__.startswith("sgl_lite") and hasattr(value, "__dict__"):
        for attribute in vars(value).values():
            yield from _walk(attribute, depth - 1)
