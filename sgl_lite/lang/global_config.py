"""Process-wide frontend settings (the default backend that run/run_batch use)."""

from __future__ import annotations

from typing import Any, Optional


class GlobalConfig:
    def __init__(self) -> None:
        # A BaseBackend, or anything with an `.endpoint` that is one (sgl.Runtime).
        self.default_backend: Optional[Any] = None


global_config = GlobalConfig()
