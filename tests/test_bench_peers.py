"""scripts/bench_peers.py's parts that need no peer: what each system is started with for --model-path and
--kv-cache-gib, its row label, its argument checks, and scripts/peers/convert_gguf.py's cached GGUF (written
through a temporary name, never half-written, clear errors when the converter or a package is missing; Q4_0
from the bf16 file by llama-quantize), run against stand-in converter and quantize scripts in a llama.cpp-shaped tree."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_peers.py"

# Stands in for llama.cpp's convert_hf_to_gguf.py: writes its output type and whether the tree's gguf-py is on
# PYTHONPATH to --outfile; with a FAIL file in the model folder it writes half a file and fails.
_CONVERTER = """
import os, sys
from pathlib import Path
args = sys.argv[1:]
folder, outtype, outfile = Path(args[0]), args[args.index("--outtype") + 1], Path(args[args.index("--outfile") + 1])
gguf_py = str(Path(__file__).parent / "gguf-py")
outfile.write_text("half")
if (folder / "FAIL").exists():
    print("converter: tensor blk.0 has an unexpected shape")
    sys.exit(3)
outfile.write_text(f"{outtype} {os.environ['PYTHONPATH'].split(os.pathsep)[0] == gguf_py}")
"""


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """An HF folder as resolve_model_path accepts it: 2 layers, 4 KV heads of 16 (512 bytes of bf16 K/V a token)."""
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                                                    "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peers) -> Path:
    """A llama.cpp tree under $PEERS as setup.sh unpacks it, with the stand-in converter; the cache in tmp_path."""
    tree = tmp_path / "peers" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    (tree / "gguf-py").mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text(_CONVERTER)
    monkeypatch.setenv("PEERS", str(tmp_path / "peers"))
    monkeypatch.setenv("SGL_LITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peers.convert_gguf, "CONVERTER_MODULES", {})  # the stand-in imports nothing beyond the stdlib
    return tree


def test_launch_args_give_every_system_the_model_and_the_same_kv_bytes(peers, model: Path) -> None:
    served = peers.Served(str(model), 1)
    tokens = 2**30 // (2 * 2 * 4 * (128 // 8) * 2)  # K and V, 2 layers, 4 heads of 16, 2 bytes each
    assert peers.launch_args("sgl_lite_w8a8", served) == ["--model-path", str(model), "--max-total-tokens", str(tokens)]
    assert peers.launch_args("vllm", served) == ["--model", str(model), "--kv-cache-gib", "1"]
    assert peers.launch_args("sgl_lite", peers.Served(str(model))) == ["--model-path", str(model)]
    assert peers.launch_args("vllm", peers.Served()) == []  # the default model: start.sh's own defaults, as before
    assert peers.launch_args("llama", peers.Served()) == []
    assert peers.launch_args("llama", peers.Served(llama_no_repack=True)) == ["--no-repack"]
    assert peers.launch_args("vllm", peers.Served(llama_no_repack=True)) == []  # a llama-server option only


def test_labels_name_the_model_the_kv_bytes_and_the_gguf_type(peers) -> None:
    served = peers.Served("random-1.7b", 4)
    assert peers.label("vllm", served) == "vLLM-CPU (bf16, prefix caching) [random-1.7b, 4 GiB KV]"
    assert peers.label("llama_q8_0", served) == "llama-server (Q8_0 GGUF) [random-1.7b]"
    assert peers.label("llama_bf16", peers.Served("random-1.7b", 4, llama_no_repack=True)) == \
        "llama-server (bf16 GGUF) [random-1.7b, --no-repack]"
    assert peers.label("sgl_lite", peers.Served()) == "sgl_lite serve (bf16, defaults)"


@pytest.mark.parametrize(("argv", "said"), [
    (["--systems", "llama", "--model-path", "random-1.7b"], "system llama serves the default model's own Q4_1 GGUF"),
    (["--kv-cache-gib", "100"], "--kv-cache-gib takes 0 to 99 GiB, not 100"),
    (["--systems", "vllm,llama_q2_k"], "unknown systems ['llama_q2_k']"),
    (["--rounds", "0", "--interleave"], "--rounds takes 1 or more, not 0"),
    (["--systems", "llama_bf16,sgl_lite", "--baseline", "vllm"], "--baseline vllm is not one of --systems llama_bf16,sgl_lite"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv: list[str], said: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert said in done.stderr


def test_interleaved_rounds_alternate_the_order_and_gather_each_systems_runs(peers, monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    calls: list[tuple[str, int, str | None]] = []
    first_rounds: list[int] = []

    def one_round(name: str, rounds: int, neighbour: str | None, workdir: Path, served, first_round: int) -> dict | None:
        calls.append((name, rounds, neighbour))
        first_rounds.append(first_round)
        if name == "llama_bf16":
            return None  # a peer that is not installed
        tok_s = 10.0 * len(calls)
        return {"system": name, "label": name, "runs": {"8": [{"output_tok_s": tok_s}], "1": [{"output_tok_s": tok_s + 1}],
                                                         "8_neighbour": [{"output_tok_s": 1.0}] if neighbour else []}}

    monkeypatch.setattr(peers, "measure", one_round)
    names = ["vllm", "llama_bf16", "sgl_lite"]
    neighbours = {"vllm": "spin", "llama_bf16": None, "sgl_lite": "spin"}
    results = peers.measure_interleaved(names, 3, neighbours, tmp_path, peers.Served(None, None, "one-message", False))
    assert [c[0] for c in calls] == names + names[::-1] + names  # each round every system once, every other reversed
    assert all(rounds == 1 for _, rounds, _ in calls) and first_rounds == [0] * 3 + [1] * 3 + [2] * 3  # each round its seeds
    assert [c[2] for c in calls] == [None] * 6 + ["spin", None, "spin"]  # the busy neighbour in the last round only
    assert [r["system"] for r in results] == ["vllm", "sgl_lite"]
    vllm, sgl = results
    assert [x["output_tok_s"] for x in vllm["runs"]["8"]] == [10.0, 60.0, 70.0]
    assert [x["output_tok_s"] for x in sgl["runs"]["1"]] == [31.0, 41.0, 91.0]
    assert len(sgl["runs"]["8_neighbour"]) == 1 and peers.report.best(sgl, "8") == 90.0


def test_the_table_divides_by_the_baseline_measured_in_the_same_run(peers) -> None:
    def result(system: str, eight: list[float], one: list[float]) -> dict:
        runs = {"8": [{"output_tok_s": x, "server_cpu_ms_per_token": 1000 / x} for x in eight],
                "1": [{"output_tok_s": x, "server_cpu_ms_per_token": 1000 / x} for x in one], "8_neighbour": []}
        return {"system": system, "label": system, "runs": runs}

    results = [result("llama_bf16", [10.0, 8.0], [5.0, 6.0]), result("sgl_lite", [25.0, 24.0], [7.2, 6.6])]
    header, _, llama, sgl = peers.report.table(results, "llama_bf16", "one core busy")
    assert "| 8 sessions vs llama_bf16 | 1 session vs llama_bf16 |" in header
    assert sgl == "| sgl_lite | 25.0 (25.0, 24.0) | 7.2 (7.2, 6.6) | - | 2.50x | 1.20x | 40.0 / 138.9 |"
    assert llama.split(" | ")[4:6] == ["1.00x", "1.00x"]
    _, _, _, no_base = peers.report.table(results, "vllm", "one core busy")  # vLLM not in this run: no ratio
    assert no_base.split(" | ")[4:6] == ["-", "-"]


def test_every_run_of_a_system_gets_prompts_of_its_own_seed(peers, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # llama-server cannot flush its prefix cache: a run repeating the warm-up's or an earlier run's prompts
    # would find them cached there and not on the servers that flush.
    seeds: list[tuple[int, int]] = []
    monkeypatch.setattr(peers, "start", lambda name, log, served: (subprocess.Popen(["sleep", "30"], start_new_session=True), "url"))
    monkeypatch.setattr(peers, "bench", lambda url, sessions, workdir, pgid, history, model, seed: seeds.append((sessions, seed)) or {})
    served = peers.Served(None, None, "one-message", False)
    peers.measure("sgl_lite", 2, "spin", tmp_path, served)
    peers.measure("sgl_lite", 1, None, tmp_path, served, first_round=2)
    assert len({seed for _, seed in seeds}) == len(seeds) - 1  # the warm-up's seed is the only one used twice
    assert seeds[0] == seeds[6] == (1, peers.WARMUP_SEED)
    assert [s for s in seeds[1:6]] == [(8, 1), (1, 101), (8, 2), (1, 102), (8, 201)]
    assert seeds[7:] == [(8, 3), (1, 103)]


def test_gguf_is_converted_once_into_the_cache_through_a_temporary_name(peers, model: Path, tree: Path, tmp_path: Path) -> None:
    args = peers.launch_args("llama_bf16", peers.Served(str(model)))
    gguf = tmp_path / "cache" / "gguf" / "tiny-llama" / "bf16.gguf"
    assert args == ["--model", str(gguf)]
    assert gguf.read_text() == "bf16 True"  # the converter got the type, with the tree's gguf-py first on PYTHONPATH
    assert [p.name for p in gguf.parent.iterdir() if "partial" in p.name] == []
    (tree / "convert_hf_to_gguf.py").write_text("import sys; sys.exit(1)")  # a cached file is not converted again
    assert peers.convert_gguf.gguf_file(str(model), "bf16") == gguf
    assert peers.launch_args("llama_bf16", peers.Served(str(model), llama_no_repack=True)) == ["--model", str(gguf), "--no-repack"]


def test_gguf_older_than_the_weights_is_converted_again(peers, model: Path, tree: Path) -> None:
    gguf = peers.convert_gguf.gguf_file(str(model), "q8_0")
    gguf.write_text("stale")
    later = time.time() + 10
    os.utime(model / "model.safetensors", (later, later))
    assert peers.convert_gguf.gguf_file(str(model), "q8_0").read_text() == "q8_0 True"


def test_a_failed_conversion_leaves_no_file_and_says_what_the_converter_said(peers, model: Path, tree: Path, tmp_path: Path) -> None:
    (model / "FAIL").write_text("")
    with pytest.raises(peers.convert_gguf.ConversionError, match="(?s)exit 3.*unexpected shape"):
        peers.convert_gguf.gguf_file(str(model), "bf16")
    folder = tmp_path / "cache" / "gguf" / "tiny-llama"
    assert sorted(p.name for p in folder.iterdir()) == ["bf16.convert.log"]  # neither the file nor its half
    assert "not started" in _started_output(peers, "llama_bf16", model, tmp_path)


# Stands in for llama-quantize SOURCE OUT TYPE: writes the source's text and the type to OUT.
_QUANTIZE = """#!/usr/bin/env python3
import sys
from pathlib import Path
source, out, kind = sys.argv[1:4]
Path(out).write_text(f"{Path(source).read_text()} -> {kind}")
"""


def test_q4_0_is_quantized_from_the_bf16_gguf_by_llama_quantize(peers, model: Path, tree: Path, tmp_path: Path) -> None:
    with pytest.raises(peers.convert_gguf.ConversionError, match="no llama-quantize at .* run: bash scripts/peers/setup.sh"):
        peers.convert_gguf.gguf_file(str(model), "q4_0")
    tool = tmp_path / "peers" / "llama-quantize"
    tool.write_text(_QUANTIZE)
    tool.chmod(0o755)
    assert peers.launch_args("llama_q4_0", peers.Served(str(model))) == ["--model", str(tmp_path / "cache" / "gguf" / "tiny-llama" / "q4_0.gguf")]
    gguf = peers.convert_gguf.gguf_file(str(model), "q4_0")
    assert gguf.read_text() == "bf16 True -> Q4_0"
    assert [p.name for p in gguf.parent.iterdir() if "partial" in p.name] == []
    tool.write_text("#!/bin/sh\nexit 1\n")  # a current file is not made again ...
    assert peers.convert_gguf.gguf_file(str(model), "q4_0") == gguf
    later = time.time() + 10
    os.utime(model / "model.safetensors", (later, later))  # ... but newer weights remake bf16, then Q4_0
    with pytest.raises(peers.convert_gguf.ConversionError, match="(?s)llama-quantize on .*bf16.gguf failed \\(exit 1"):
        peers.convert_gguf.gguf_file(str(model), "q4_0")
    assert gguf.read_text() == "bf16 True -> Q4_0"  # a failed run replaces nothing


def _started_output(peers, name: str, model: Path, tmp_path: Path) -> str:
    """What bench_peers.start prints for a system it cannot start (it returns no process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        proc, _ = peers.start(name, tmp_path / "server.log", peers.Served(str(model)))
    assert proc is None
    return out.getvalue()


def test_a_missing_converter_or_package_is_named(peers, model: Path, tree: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers.convert_gguf, "CONVERTER_MODULES", {"json": "json", "no_such_module_here": "no-such-package"})
    assert peers.convert_gguf.missing_packages(peers.convert_gguf.CONVERTER_MODULES) == ["no-such-package"]
    with pytest.raises(peers.convert_gguf.ConversionError, match="needs the python packages no-such-package"):
        peers.convert_gguf.gguf_file(str(model), "bf16")
    monkeypatch.setenv("PEERS", str(tmp_path / "empty"))
    with pytest.raises(peers.convert_gguf.ConversionError, match="no llama.cpp converter .* run: bash scripts/peers/setup.sh"):
        peers.convert_gguf.gguf_file(str(model), "bf16")
    with pytest.raises(peers.convert_gguf.ConversionError, match="GGUF type 'q2_k' is not one of bf16, q8_0, q4_0"):
        peers.convert_gguf.gguf_path("tiny-llama", "q2_k")


@pytest.mark.parametrize(("peer", "flags", "said"), [
    ("vllm", ["--kv-cache-bytes", "12"], "--kv-cache-bytes takes a whole number of bytes from 1 MiB to 99 GiB, not '12'"),
    ("vllm", ["--kv-cache-bytes", "1073741824", "--kv-cache-gib", "1"], "give --kv-cache-gib or --kv-cache-bytes, not both"),
    ("vllm", ["--max-model-len", "0"], "--max-model-len takes a whole number of tokens from 1 to 131072, not '0'"),
    ("llama", ["--max-model-len", "4096"], "--max-model-len is vllm's"),
])
def test_start_sh_refuses_bad_kv_and_length_flags_with_what_was_wrong(peers, model: Path, peer: str,
                                                                      flags: list[str], said: str) -> None:
    model_flag = ["--model", str(model)] if peer == "vllm" else []
    with pytest.raises(peers.PeerNotStarted, match=f"^start.sh: {re.escape(said)}"):
        peers.start_peer(peer, [*model_flag, *flags])
