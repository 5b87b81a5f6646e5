"""A GGUF file of a model for llama-server, made once by llama.cpp's own converter and cached.

llama-server serves only GGUF files; to compare it with sgl_lite on the same weights, the model's HF
folder (what `--model-path` resolves to: an alias, a `random-<shape>` model or a folder) is converted by
`convert_hf_to_gguf.py` from the llama.cpp tree that setup.sh unpacked ($PEERS/src/llama_cpp_python-*/
vendor/llama.cpp), run under this python with the tree's gguf-py first on PYTHONPATH. The file is cached
at <sgl_lite cache>/gguf/<folder name>/<outtype>.gguf, written under a temporary name beside it and
renamed only when the converter succeeded, so a half-written file is never served; a cached file older
than the model's weights is converted again. Q4_0, which the converter does not write, is made from the
bf16 file by llama.cpp's `llama-quantize` (setup.sh builds it beside llama-server), the same way.

    python scripts/peers/convert_gguf.py --model-path random-1.7b --outtype q8_0
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sgl_lite.runtime.model_executor.loader import LoaderError, cache_root, resolve_model_path  # noqa: E402

CONVERTER_OUTTYPES = ("bf16", "q8_0")  # the converter's own output types that llama-server is compared at
QUANTIZE_OUTTYPES = {"q4_0": "Q4_0"}  # made from the bf16 file by llama-quantize: outtype -> its type name
OUTTYPES = (*CONVERTER_OUTTYPES, *QUANTIZE_OUTTYPES)
# What the converter imports for a Llama model (module -> its pip package): the Llama vocab path imports
# sentencepiece even for a BPE tokenizer; gguf-py needs yaml, tqdm and requests.
CONVERTER_MODULES = {"numpy": "numpy", "torch": "torch", "transformers": "transformers", "sentencepiece": "sentencepiece",
                     "yaml": "pyyaml", "tqdm": "tqdm", "requests": "requests"}
CONVERT_TIMEOUT_S = 3600  # a 3B model's q8_0 conversion takes minutes on 2 cores; a hung one is ended
LOG_TAIL_CHARS = 2000


class ConversionError(Exception):
    """The GGUF file cannot be made; the message names what is missing or the converter's last output."""


def peers_dir() -> Path:
    """Where setup.sh installed the peers: $PEERS, else artifacts/peers of this checkout."""
    return Path(os.environ.get("PEERS") or ROOT / "artifacts" / "peers").expanduser()


def llama_cpp_tree(peers: Path) -> Path:
    """The llama.cpp source tree with convert_hf_to_gguf.py that setup.sh unpacked under `peers` (the newest)."""
    trees = sorted(t for t in peers.glob("src/llama[_-]cpp[_-]python-*/vendor/llama.cpp") if (t / "convert_hf_to_gguf.py").is_file())
    if not trees:
        raise ConversionError(f"no llama.cpp converter (src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py) "
                              f"under {peers}; run: bash scripts/peers/setup.sh")
    return trees[-1]


def missing_packages(modules: dict[str, str]) -> list[str]:
    """The pip packages of `modules` (module -> package) that this python cannot import."""
    return [package for module, package in modules.items() if importlib.util.find_spec(module) is None]


def gguf_path(model_name: str, outtype: str, cache: Path | None = None) -> Path:
    """Where the `outtype` GGUF of the model folder named `model_name` is cached."""
    if outtype not in OUTTYPES:
        raise ConversionError(f"GGUF type {outtype!r} is not one of {', '.join(OUTTYPES)}")
    return (cache or cache_root()) / "gguf" / model_name / f"{outtype}.gguf"


def is_current(gguf: Path, sources: list[Path]) -> bool:
    """Whether a cached GGUF exists and is newer than every file it was made from."""
    if not gguf.is_file():
        return False
    made = gguf.stat().st_mtime
    return all(w.stat().st_mtime <= made for w in sources)


def produce(command_for: Callable[[Path], list[str]], out: Path, what: str, env: dict[str, str] | None = None) -> Path:
    """Run `command_for(partial)`, a command that writes the file `partial`, and rename that to `out` only if it
    succeeded (its output in <out stem>.convert.log; `what` names it in errors)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    log = out.with_name(f"{out.stem}.convert.log")
    try:
        with log.open("w") as log_file:
            try:
                done = subprocess.run(command_for(partial), stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=CONVERT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise ConversionError(f"{what} ran past {CONVERT_TIMEOUT_S} s; see {log}") from None
        if done.returncode != 0 or not partial.is_file():
            tail = log.read_text(errors="replace")[-LOG_TAIL_CHARS:].strip()
            raise ConversionError(f"{what} failed (exit {done.returncode}; log {log}):\n{tail}")
        os.replace(partial, out)  # the cached name only ever holds a complete file
    finally:
        partial.unlink(missing_ok=True)
    return out


def convert(folder: Path, outtype: str, out: Path, tree: Path) -> Path:
    """Run the converter of `tree` on `folder` into `out`."""
    missing = missing_packages(CONVERTER_MODULES)
    if missing:
        raise ConversionError(f"convert_hf_to_gguf.py needs the python packages {', '.join(missing)}, missing from "
                              f"{sys.executable}; install them: {sys.executable} -m pip install {' '.join(missing)}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tree / "gguf-py"), os.environ.get("PYTHONPATH")) if p))
    return produce(lambda partial: [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                                    "--outfile", str(partial)], out, f"convert_hf_to_gguf.py on {folder}", env)


def quantize(source: Path, outtype: str, out: Path, peers: Path) -> Path:
    """`source` (a bf16 GGUF) quantized to `outtype` by setup.sh's llama-quantize, into `out`."""
    tool = peers / "llama-quantize"
    if not os.access(tool, os.X_OK):
        raise ConversionError(f"no llama-quantize at {tool} (it makes {QUANTIZE_OUTTYPES[outtype]} GGUFs); run: bash scripts/peers/setup.sh")
    return produce(lambda partial: [str(tool), str(source), str(partial), QUANTIZE_OUTTYPES[outtype]], out,
                   f"llama-quantize on {source}")


def gguf_file(model_path: str, outtype: str, peers: Path | None = None, cache: Path | None = None) -> Path:
    """The cached `outtype` GGUF of `model_path` (resolved as sgl_lite resolves --model-path), made if absent or stale."""
    folder = resolve_model_path(model_path)
    out = gguf_path(folder.name, outtype, cache)
    if outtype in QUANTIZE_OUTTYPES:
        source = gguf_file(model_path, "bf16", peers, cache)
        return out if is_current(out, [source]) else quantize(source, outtype, out, peers or peers_dir())
    if is_current(out, list(folder.glob("*.safetensors"))):
        return out
    return convert(folder, outtype, out, llama_cpp_tree(peers or peers_dir()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="an alias, random-<shape>, a .gguf file or an HF folder")
    parser.add_argument("--outtype", choices=OUTTYPES, required=True)
    args = parser.parse_args()
    try:
        print(gguf_file(args.model_path, args.outtype))
    except (ConversionError, LoaderError) as e:
        sys.exit(f"convert_gguf.py: {e}")


if __name__ == "__main__":
    main()
