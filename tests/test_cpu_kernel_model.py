"""The cpu_kernel attention backend inside a whole (tiny) model: greedy tokens against transformers' own, and
its fp8 pool against the torch path's, over contexts the decode kernel splits into chunks."""

from __future__ import annotations

import pytest
import torch
from test_attention_cpu_kernel import op  # noqa: F401 - fixture

from sgl_lite.runtime.layers.attention import TorchNativeBackend
from sgl_lite.runtime.layers.attention.cpu_kernel import CpuKernelBackend
from sgl_lite.runtime.model_executor.model_runner import ModelRunner
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.testing.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny_gqa3(tmp_path_factory):
    """A tiny Llama with SmolLM2's head layout (3 query heads per KV head), long enough positions for split contexts."""
    from test_model import hf_model

    path = make_tiny_model(tmp_path_factory.mktemp("gqa3"), hidden_size=96, num_heads=6, num_kv_heads=2)
    return path, hf_model(path)


def _runner(path, backend: str, kv: str = "auto") -> ModelRunner:
    args = ServerArgs(model_path=str(path), dtype="float32", device="cpu", max_total_tokens=4096, max_running_requests=8,
                      attention_backend=backend, kv_cache_dtype=kv)
    return ModelRunner(args, model_dir=path)


# 600 tokens: the kernel cuts that context into chunks (at least 256 tokens each) and merges them.
LENGTHS = [600, 5, 37]


@pytest.mark.parametrize("backend", ["cpu_kernel", "torch_native"])
def test_tiny_model_greedy_matches_transformers_fp32(op, tiny_gqa3, backend):
    from test_model import Driver, hf_greedy, prompts

    path, ref = tiny_gqa3
    runner = _runner(path, backend)
    assert type(runner.attn) is {"cpu_kernel": CpuKernelBackend, "torch_native": TorchNativeBackend}[backend]
    driver = Driver(runner)
    batch = prompts(runner.vocab_size, LENGTHS, seed=11)
    ours = driver.generate([driver.new_req(str(i), p) for i, p in enumerate(batch)], 24, chunk=256)
    assert ours == [hf_greedy(ref, p, 24) for p in batch]


def test_tiny_model_fp8_kv_kernel_matches_torch_path(op, tiny_gqa3):
    """With an fp8 pool both backends read the same stored values: greedy outputs agree token for token."""
    from test_model import Driver, prompts

    path, _ = tiny_gqa3
    outputs = []
    for backend in ("cpu_kernel", "torch_native"):
        runner = _runner(path, backend, kv="fp8_e4m3")
        assert runner.kv_pool.dtype is torch.float8_e4m3fn and runner.kv_cache_summary()["dtype"] == "float8_e4m3fn"
        driver = Driver(runner)
        batch = prompts(runner.vocab_size, LENGTHS, seed=12)
        outputs.append(driver.generate([driver.new_req(str(i), p) for i, p in enumerate(batch)], 16))
    assert outputs[0] == outputs[1]
