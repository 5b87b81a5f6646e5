"""Chat templates shipped with sgl_lite, and `--chat-template` resolution (a built-in name or a file path).

The runtime installs the chosen template as its tokenizer's chat template, so the DSL and the HTTP
front (which both read the template from server_info) render the same one.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
BUILTIN = {path.stem: path for path in sorted(_HERE.glob("*.jinja"))}
# A template file larger than this is not a chat template (they are a few KB).
MAX_TEMPLATE_BYTES = 1 << 20


def load_chat_template(value: str) -> str:
    """The template source for --chat-template VALUE; ValueError naming the flag when it cannot be read."""
    path = BUILTIN.get(value) or Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"--chat-template must be a template file or one of {', '.join(BUILTIN)}; got {value!r}")
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise ValueError(f"--chat-template file {path} is larger than {MAX_TEMPLATE_BYTES} bytes")
    return path.read_text(encoding="utf-8")
