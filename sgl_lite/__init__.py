"""sgl_lite: a compact SGLang-style serving system. `import sgl_lite as sgl`.

The DSL surface is torch-free; runtime classes (Engine) are imported lazily on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from sgl_lite.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'sgl_lite' has no attribute {name!r}")
