"""sgl_lite: a compact SGLang-style serving system. `import sgl_lite as sgl`.

The DSL surface is SGLang's frontend language: existing SGLang programs run by changing the import
line. It is torch-free; runtime classes (Engine, RuntimeEndpoint's ZeroMQ client) are imported
lazily on first use so that `import sgl_lite` stays fast.
"""

from __future__ import annotations

from typing import Any

from sgl_lite.lang.api import (
    Runtime,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from sgl_lite.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from sgl_lite.lang.global_config import global_config

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "OpenAI",
    "Runtime",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from sgl_lite.runtime.server.engine import Engine

        return Engine
    if name == "OpenAI":
        from sgl_lite.lang.backend.openai import OpenAI

        return OpenAI
    if name == "RuntimeEndpoint":
        from sgl_lite.lang.backend.runtime_endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    raise AttributeError(f"module 'sgl_lite' has no attribute {name!r}")
