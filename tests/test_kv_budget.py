"""The KV pool's size: what the device has left after the weights, less a prefill chunk's activations, times
--mem-fraction-static (model_executor/kv_budget.py), and what the start-up log says of it."""

from __future__ import annotations

import logging

import pytest
import torch

from sgl_lite.runtime.model_executor import model_runner
from sgl_lite.runtime.model_executor.kv_budget import CPU_MEM_FRACTION, MAX_CONTEXTS, kv_budget
from sgl_lite.runtime.model_executor.model_runner import ModelRunner
from sgl_lite.runtime.server_args import ServerArgs

GIB = 2**30
CPU = torch.device("cpu")
# SmolLM2-1.7B's shape in bf16: 24 layers x 2 x 32 KV heads x 64 x 2 bytes a token.
PER_TOKEN_1_7B = 24 * 2 * 32 * 64 * 2


def test_a_realistic_model_on_a_24_gib_machine_holds_many_contexts() -> None:
    """~19 GiB left after 1.7B's weights: half of it, less the activations, is ~48k tokens: 11 contexts of 4096."""
    budget = kv_budget(CPU, 19 * GIB, PER_TOKEN_1_7B, 4096, 2048, 8192, chunk_tokens=2048)
    assert budget.activation_bytes == 2048 * (4 * 2048 + 2 * 8192) * 4
    assert budget.slots == int((19 * GIB - budget.activation_bytes) * CPU_MEM_FRACTION) // PER_TOKEN_1_7B
    assert budget.full_contexts > 10


def test_the_fraction_the_cap_and_tp_ranks() -> None:
    half = kv_budget(CPU, 8 * GIB, 4096, 65536, 64, 128, chunk_tokens=16).slots
    assert kv_budget(CPU, 8 * GIB, 4096, 65536, 64, 128, chunk_tokens=16, fraction=0.25).slots == pytest.approx(half / 2, abs=1)
    assert kv_budget(CPU, 8 * GIB, 4096, 65536, 64, 128, chunk_tokens=16, ranks_sharing_memory=2).slots == pytest.approx(half / 2, abs=1)
    # a tiny model on a big machine: never more than MAX_CONTEXTS full contexts
    assert kv_budget(CPU, 512 * GIB, 8, 256, 64, 128, chunk_tokens=16).slots == MAX_CONTEXTS * 256
    # activations larger than what is left: no pool
    assert kv_budget(CPU, GIB, 1024, 256, 4096, 16384, chunk_tokens=8192).slots == 0


def test_the_runner_sizes_its_pool_so_and_says_how_many_contexts(tiny_llama_dir, monkeypatch, caplog) -> None:
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: 64 * 2**20)
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        runner = ModelRunner(ServerArgs(model_path=str(tiny_llama_dir), dtype="float32", device="cpu", context_length=256),
                             model_dir=tiny_llama_dir)
    config = runner.config
    expected = kv_budget(CPU, 64 * 2**20, runner.kv_pool.bytes_per_slot(config.num_hidden_layers, runner.model.num_kv_heads,
                                                                      runner.model.head_dim, runner.kv_dtype),
                         256, config.hidden_size, config.intermediate_size, 8192)
    assert runner.num_slots == expected.slots > 0
    assert any("full contexts of 256" in r.getMessage() for r in caplog.records)


def test_no_room_for_a_pool_is_a_clear_error(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: 1024)
    with pytest.raises(ValueError, match="--max-total-tokens"):
        ModelRunner(ServerArgs(model_path=str(tiny_llama_dir), dtype="float32", device="cpu", context_length=256), model_dir=tiny_llama_dir)
