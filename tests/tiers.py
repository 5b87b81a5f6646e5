"""Which tier a test belongs to, from what it uses: conftest.py marks every collected test with these.

A test's code is its own function, the fixtures it requests and, transitively, the module-level
functions and fixtures those name; a marker applies when that code matches the marker's pattern.
`scripts/test.sh --fast` runs the tests with none of these markers (unit, kernel and in-process tests).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from pathlib import Path

import pytest

# marker -> (what the code does to earn it, the pattern that says so)
MARKERS: dict[str, tuple[str, str]] = {
    "server": ("starts a process (a runtime, an HTTP front, a router, a CLI run, grammar compile workers) or a server thread",
               r"\bsubprocess\b|Popen|\bRuntime\(|HttpServerThread|run_http_server|multiprocessing|RuntimeServer\(|"
               r"start_server|spawn_|Cluster\(|tp_size=[2-9]|sys\.executable|\bRouter\(|RuntimeServer|health_timeout=|"
               r"HttpFront|uvicorn|Engine\(.*tp_size=|open_system\(|run_benchmark\(|"
               # a grammar compiled through a backend or an engine runs in the compile worker processes
               r"GrammarBackend\(|\btiny_backend\b|[\"']json_schema[\"']: |json_schema=|[\"']regex[\"']: |regex=|[\"']ebnf[\"']: "),
    "default_model": ("loads the real default model (SmolLM2-135M)", r"default_model_dir|mark\.default_model|DEFAULT_MODEL"),
    "soak": ("runs a soak or a property-based fuzz", r"\bsoak\b|run_soak|hypothesis|@given"),
    "kernel_build": ("compiles C++ (a kernel build in a fresh cache, or every source for other targets)",
                     r"_load_or_build|load_cpu_ops\.__wrapped__|-fsyntax-only"),
}


@functools.cache
def _module_functions(path: Path) -> dict[str, str]:
    """Module-level function (and fixture) name -> its source, of one test module or conftest."""
    text = path.read_text()
    tree = ast.parse(text)
    return {node.name: ast.get_source_segment(text, node) or "" for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _fixture_source(item: pytest.Function, name: str) -> str:
    """The source of fixture `name` as this test resolves it (one imported from another test module too)."""
    definitions = item._fixtureinfo.name2fixturedefs.get(name)
    if not definitions:
        return ""
    try:
        return inspect.getsource(definitions[-1].func)
    except (OSError, TypeError):  # a builtin fixture of pytest's
        return ""


def _code_of(item: pytest.Function) -> str:
    """The test's source, and that of every module-level function or fixture it reaches by name."""
    module = Path(str(item.fspath))
    functions = {**_module_functions(Path(__file__).with_name("conftest.py")), **_module_functions(module)}
    seen: set[str] = set()
    todo = [item.originalname, *item.fixturenames]
    parts: list[str] = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        source = functions.get(name) or _fixture_source(item, name)
        if not source:
            continue
        parts.append(source)
        todo.extend(re.findall(r"[A-Za-z_]\w*", source))
    # the module's pytestmark counts for every test of the module
    module_level = module.read_text()
    parts.extend(line for line in module_level.splitlines() if line.startswith("pytestmark"))
    return "\n".join(parts)


def mark(items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        code = _code_of(item)
        for marker, (_, pattern) in MARKERS.items():
            if re.search(pattern, code):
                item.add_marker(getattr(pytest.mark, marker))
