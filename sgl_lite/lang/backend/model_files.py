"""The chat template facts of a served model, for a backend whose server does not report them.

An sgl_lite server's /get_model_info and /server_info carry the tokenizer's chat template and its bos/eos
tokens as the runtime holds them (with `--chat-template` applied); sglang-router passes a worker's
/get_model_info on. SGLang's own /get_model_info names only the model and tokenizer paths (its frontend
guesses a template from the model's name); the template is then read from the
tokenizer's own files, the ones transformers loads it from: `tokenizer_config.json` (chat_template,
bos_token, eos_token), else `chat_template.jinja` or `chat_template.json` beside it. They are read from
the path itself when it is a folder on this machine, else from the Hugging Face cache when it holds
that repository's files (nothing is downloaded). When nothing is found the facts have no template, and
the endpoint falls back to ChatML (lang/chat_template.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def is_jinja_template(value: Any) -> bool:
    """A chat template's text, as opposed to a template's name or file (what SGLang's server args hold)."""
    return isinstance(value, str) and ("{%" in value or "{{" in value)


def served_model_facts(server_info: dict[str, Any], model_info: dict[str, Any]) -> dict[str, Any]:
    """model_path, chat_template, bos_token and eos_token, as chat_template_from_model_info reads them."""
    facts: dict[str, Any] = {"model_path": model_info.get("model_path")}
    for reported in (model_info, server_info):
        if is_jinja_template(reported.get("chat_template")):
            facts.update({key: reported.get(key) for key in ("chat_template", "bos_token", "eos_token")})
            return facts
    facts.update(tokenizer_facts(model_info.get("tokenizer_path") or model_info.get("model_path")))
    return facts


def tokenizer_facts(path: Optional[str]) -> dict[str, Any]:
    """chat_template, bos_token, eos_token from the tokenizer files at `path` (those found)."""
    files = _template_files(path)
    config = _read_json(files.get("tokenizer_config.json"))
    facts = {"bos_token": _token(config.get("bos_token")), "eos_token": _token(config.get("eos_token")),
             "chat_template": _default_template(config.get("chat_template"))}
    if facts["chat_template"] is None and "chat_template.jinja" in files:
        facts["chat_template"] = _read_text(files["chat_template.jinja"])
    if facts["chat_template"] is None and "chat_template.json" in files:
        facts["chat_template"] = _default_template(_read_json(files["chat_template.json"]).get("chat_template"))
    return {key: value for key, value in facts.items() if value}


def _template_files(path: Optional[str]) -> dict[str, Path]:
    if not path:
        return {}
    folder = Path(path).expanduser()
    if folder.is_dir():
        return {name: folder / name for name in TEMPLATE_FILES if (folder / name).is_file()}
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return {}
    files: dict[str, Path] = {}
    for name in TEMPLATE_FILES:
        try:
            found = try_to_load_from_cache(path, name)
        except Exception as e:  # not a repository id (a path on the server's machine): nothing cached
            logger.debug("no cached tokenizer files for %r: %r", path, e)
            return {}
        if isinstance(found, str):
            files[name] = Path(found)
    return files


def _default_template(value: Any) -> Optional[str]:
    """A template string, or from a list of named templates (tokenizer_config's form) the default one."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    return None


def _token(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Optional[Path]) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        logger.warning("could not read %s: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _read_text(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        logger.warning("could not read %s: %s", path, e)
        return None
