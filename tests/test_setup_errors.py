"""Every setup mistake of `sgl-lite serve` is one line naming the flag and what to do, not a traceback
(issue 19, item 3). Each runs the real command in this process (CliRunner) on the tiny random model
with free loopback ports; the checks happen before the model loads, so nothing is served."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sgl_lite.cli import main
from sgl_lite.runtime.server_args import ServerArgs


def _serve_error(model: Path, *flags: str) -> str:
    result = CliRunner().invoke(main, ["serve", "--model-path", str(model), "--port", "0", "--log-level", "error",
                                       *flags])
    assert result.exit_code in (1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_tp_size_that_does_not_divide_the_heads(tiny_llama_dir):
    line = _serve_error(tiny_llama_dir, "--tp-size", "3")
    assert "--tp-size 3" in line and "4 heads" in line


def test_context_length_beyond_the_models(tiny_llama_dir):
    line = _serve_error(tiny_llama_dir, "--context-length", "4096")
    assert "--context-length 4096" in line and "2048" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(tiny_llama_dir):
    line = _serve_error(tiny_llama_dir, "--device", "cuda")
    assert "--device cuda" in line and "CUDA is not available" in line and "--device cpu" in line


def test_flashinfer_on_cpu(tiny_llama_dir):
    line = _serve_error(tiny_llama_dir, "--device", "cpu", "--attention-backend", "flashinfer")
    assert "CUDA only" in line and "torch_native" in line


def test_flashinfer_missing_on_cuda(tiny_llama_dir, monkeypatch):
    # The machine is faked to have CUDA (there is none here); FlashInfer is really not installed.
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("FlashInfer is installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    line = _serve_error(tiny_llama_dir, "--device", "cuda")
    assert "FlashInfer" in line and "pip install flashinfer-python" in line


def test_tp_size_beyond_the_gpus(tiny_llama_dir, monkeypatch):
    # The machine is faked to have one GPU (there is none here); 2 heads per rank divide evenly.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = _serve_error(tiny_llama_dir, "--device", "cuda", "--attention-backend", "torch_native", "--tp-size", "2")
    assert "--tp-size 2" in line and "has 1" in line


def test_priority_as_a_policy_name_points_at_the_flag(tiny_llama_dir):
    line = _serve_error(tiny_llama_dir, "--schedule-policy", "priority")
    assert "--enable-priority-scheduling" in line
    with pytest.raises(ValueError, match="--enable-priority-scheduling"):  # Engine(**kwargs) and sgl.Runtime
        ServerArgs(schedule_policy="priority")


def test_missing_model(tmp_path):
    line = _serve_error(tmp_path / "no-such-model")
    assert "no-such-model" in line



def test_an_empty_api_key_is_refused(tiny_llama_dir):
    """An empty key is no secret (an empty bearer token), and ZeroMQ's handshake cannot carry a key over 255 bytes."""
    line = _serve_error(tiny_llama_dir, "--api-key", "")
    assert "--api-key must not be empty" in line
    with pytest.raises(ValueError, match="--api-key"):
        ServerArgs(api_key="")
    with pytest.raises(ValueError, match="at most 255"):
        ServerArgs(api_key="k" * 256)
