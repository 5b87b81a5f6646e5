"""The folder tells the layer, and no import runs from a lower layer to a higher one.

Read from the source with `ast` (imports inside functions count too: a lazy import is still a
dependency). Each module gets the rank of the longest prefix listed in LAYERS; a module may import
modules of its own rank or lower. Two top-level clients of the runtime (lang, http) sit above it, and
the tools that assemble everything (cli, cluster, bench, sim, testing) above them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "sgl_lite"

# Lower rank = lower layer. Within the runtime: wire format and flags, then the request record,
# KV memory, model building blocks, model execution, scheduling, and the process that drives it.
LAYERS: dict[str, int] = {
    "sgl_lite.runtime.protocol": 0,
    "sgl_lite.runtime.server_args": 0,
    "sgl_lite.runtime.free_port": 0,
    "sgl_lite.runtime": 0,  # the package docstring only
    "sgl_lite.runtime.client": 1,
    "sgl_lite.runtime.managers.request": 1,
    "sgl_lite.runtime.mem_cache": 2,
    "sgl_lite.runtime.kernels": 3,
    "sgl_lite.runtime.layers": 3,
    "sgl_lite.runtime.models": 3,
    "sgl_lite.runtime.sampling": 3,
    "sgl_lite.runtime.speculative": 3,
    "sgl_lite.runtime.model_executor": 4,
    "sgl_lite.runtime.managers": 5,
    "sgl_lite.runtime.server": 6,
    "sgl_lite.lang": 7,
    "sgl_lite": 7,  # the public surface (__init__): the DSL, Engine exported lazily
    "sgl_lite.http": 8,
    "sgl_lite.cluster": 9,
    "sgl_lite.cli": 9,
    "sgl_lite.__main__": 9,
    "sgl_lite.demo_agent": 9,
    "sgl_lite.bench": 9,
    "sgl_lite.sim": 9,
    "sgl_lite.testing": 9,
}
# Exceptions, each with its reason: the public package exports the in-process Engine lazily (SGLang's
# `sgl.Engine`), which is a runtime class by nature.
ALLOWED = {("sgl_lite", "sgl_lite.runtime.server.engine")}
# Modules that must never import torch (directly): the frontend, the wire format and the client.
TORCH_FREE = ("sgl_lite.lang", "sgl_lite.runtime.protocol", "sgl_lite.runtime.server_args",
              "sgl_lite.runtime.client", "sgl_lite.http")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from sgl_lite.x import y` may name a submodule y.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _rank(module: str) -> int | None:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in LAYERS:
            return LAYERS[prefix]
    return None


def _is_module(name: str) -> bool:
    relative = pathlib.Path(*name.split("."))
    return (PACKAGE.parent / relative).with_suffix(".py").is_file() or (PACKAGE.parent / relative).is_dir()


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if _rank(m) is None] == []


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    upward = []
    for module, path in MODULES.items():
        for imported in _imports(path):
            if not imported.startswith("sgl_lite") or not _is_module(imported):
                continue
            if (module, imported) in ALLOWED:
                continue
            if _rank(imported) > _rank(module):
                upward.append(f"{module} (layer {_rank(module)}) imports {imported} (layer {_rank(imported)})")
    assert upward == []


def test_lang_and_http_are_separate_clients() -> None:
    # The DSL never reaches into the HTTP front (it is a peer client of the runtime, not a user of it).
    wrong = [(m, i) for m, p in MODULES.items() if m.startswith("sgl_lite.lang")
             for i in _imports(p) if i.startswith("sgl_lite.http")]
    assert wrong == []


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_torch_free_modules_do_not_import_torch(prefix: str) -> None:
    offenders = [m for m, p in MODULES.items() if m.startswith(prefix)
                 and any(i == "torch" or i.startswith("torch.") for i in _imports(p))]
    assert offenders == []


def test_the_checker_sees_an_upward_import(tmp_path: pathlib.Path) -> None:
    # The rule must be able to fail: a radix-cache module importing the scheduler is caught.
    source = tmp_path / "bad.py"
    source.write_text("from sgl_lite.runtime.managers.scheduler import Scheduler\n")
    imported = _imports(source)
    module = "sgl_lite.runtime.mem_cache.radix_cache"
    assert any(_is_module(i) and _rank(i) > _rank(module) for i in imported)
