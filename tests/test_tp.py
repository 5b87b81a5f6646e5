"""Tensor parallelism on CPU (gloo): a model sharded over N processes gives one process's results.

Each test runs the same greedy requests on an Engine with tp_size 1 and one with tp_size N (rank 0
in this process, ranks 1..N-1 spawned by it) and compares tokens and logprobs; the references come
from the unsharded runtime itself, never from constants.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch.distributed
import transformers
from safetensors.torch import load_file

from sgl_lite.lang.launcher import Runtime
from sgl_lite.runtime.model_executor.tp import check_shardable
from sgl_lite.runtime.server.engine import Engine
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["The quick brown fox jumps over", "What is the capital of France? Paris is", "def add(a, b): return"]
# Few decode steps: on CPU every step costs two gloo all-reduces per layer across the rank processes.
GREEDY = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}


def run(model_dir: Path, tp_size: int, repeats: int = 1) -> list[list[dict[str, Any]]]:
    engine = Engine(str(model_dir), dtype="float32", tp_size=tp_size, max_total_tokens=4096)
    try:
        return [engine.generate(PROMPTS, GREEDY, return_logprob=True) for _ in range(repeats)]
    finally:
        engine.shutdown()


def assert_same_results(single: list[dict[str, Any]], sharded: list[dict[str, Any]]) -> None:
    for one, tp in zip(single, sharded):
        assert tp["output_ids"] == one["output_ids"]
        one_lp = [lp for lp, _, _ in one["meta_info"]["output_token_logprobs"]]
        tp_lp = [lp for lp, _, _ in tp["meta_info"]["output_token_logprobs"]]
        assert tp_lp == pytest.approx(one_lp, abs=1e-3)


def test_head_counts_that_do_not_divide_are_refused() -> None:
    config = transformers.LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                                      intermediate_size=1536)
    with pytest.raises(ValueError, match="--tp-size 2 does not divide the model's 9 attention heads"):
        check_shardable(config, 2)
    with pytest.raises(ValueError, match="--tp-size 9 does not divide the model's 3 KV heads"):
        check_shardable(config, 9)
    check_shardable(config, 3)
    with pytest.raises(ValueError, match="--tp-size must be >= 1"):
        ServerArgs(tp_size=0)


def test_engine_refuses_a_tp_size_that_does_not_divide_the_kv_heads(tiny_llama_dir: Path) -> None:
    # The tiny model has 4 heads and 2 KV heads: 4 ranks cannot each hold a KV head.
    with pytest.raises(ValueError, match="--tp-size 4 does not divide the model's 2 KV heads"):
        Engine(str(tiny_llama_dir), dtype="float32", tp_size=4, max_total_tokens=1024)
    assert not torch.distributed.is_initialized()  # refused before any rank was started


def test_tp2_matches_one_process_with_and_without_cache_hits(tiny_llama_dir: Path) -> None:
    single = run(tiny_llama_dir, 1)[0]
    first, again = run(tiny_llama_dir, 2, repeats=2)
    assert_same_results(single, first)
    # The second round hits the (sharded) prefix cache and must not change a result.
    assert all(r["meta_info"]["cached_tokens"] > 0 for r in again)
    assert_same_results(single, again)


def test_tp2_with_speculative_decoding_matches_one_process(tiny_llama_dir: Path) -> None:
    """Verification rows (several query tokens each) reach the other ranks with their decode-path flag."""
    prompt = "one two three four five one two three four five one two three"
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    single = Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=4096)
    try:
        want = single.generate(prompt, params, return_logprob=True)
    finally:
        single.shutdown()
    sharded = Engine(str(tiny_llama_dir), dtype="float32", tp_size=2, max_total_tokens=4096, speculative_algorithm="ngram")
    try:
        got = sharded.generate(prompt, params, return_logprob=True)
        assert got["meta_info"]["spec_verify_ct"] > 0
        assert_same_results([want], [got])
    finally:
        sharded.shutdown()
        sharded.core.scheduler.check_invariant()


def test_tp2_matches_one_process_on_qwen2_with_sharded_qkv_biases(tiny_qwen2_dir: Path) -> None:
    # Qwen2 has q/k/v biases: each rank must keep the bias rows of its own heads.
    weights = load_file(tiny_qwen2_dir / "model.safetensors")
    assert any(name.endswith("self_attn.k_proj.bias") and t.abs().sum() > 0 for name, t in weights.items())
    assert_same_results(run(tiny_qwen2_dir, 1)[0], run(tiny_qwen2_dir, 2)[0])


def test_tp2_matches_one_process_on_qwen3_with_replicated_qk_norms(tmp_path: Path) -> None:
    # Qwen3's q/k norms act within one head: every rank keeps them whole for its own heads.
    path = make_tiny_model(tmp_path, arch="qwen3", head_dim=32)
    assert_same_results(run(path, 1)[0], run(path, 2)[0])


def tp_rank_pids(parent: int | None = None) -> set[int]:
    """The live children of `parent` (this process) that run a tensor-parallel rank (from /proc; zombies
    count as gone)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(ppid) == (parent or os.getpid()) and state != "Z" and b"sgl_lite.runtime.model_executor.tp" in cmdline:
            pids.add(int(entry.name))
    return pids


def test_engine_shutdown_stops_the_tp_ranks(tiny_llama_dir: Path) -> None:
    assert not tp_rank_pids()
    engine = Engine(str(tiny_llama_dir), dtype="float32", tp_size=2, max_total_tokens=1024)
    try:
        ranks = tp_rank_pids()
        assert len(ranks) == 1  # rank 1; rank 0 is this process
        assert engine.generate("hello", GREEDY)["output_ids"]
        engine.shutdown()  # returns once the ranks have exited: no polling needed
        assert not tp_rank_pids()
        assert not torch.distributed.is_initialized()  # another TP engine may start in this process
        with pytest.raises(RuntimeError, match="shut down"):
            engine.generate("hello", GREEDY)
        engine.shutdown()  # idempotent
    finally:
        engine.shutdown()


def test_a_server_that_loses_a_rank_exits(tiny_llama_dir: Path) -> None:
    """Without rank 1 every forward fails while heartbeats and /health still answer: the server exits
    (non-zero), so that its clients fail at once and a router or supervisor sees it gone."""
    runtime = Runtime(model_path=str(tiny_llama_dir), dtype="float32", tp_size=2, max_total_tokens=1024,
                      log_level="warning", startup_timeout=180)
    try:
        (rank1,) = tp_rank_pids(runtime.pid)
        os.kill(rank1, signal.SIGKILL)
        assert runtime.process.wait(30) != 0
    finally:
        runtime.shutdown()


@pytest.mark.default_model
def test_tp3_matches_one_process_on_the_default_model(default_model_dir: Path) -> None:
    # SmolLM2-135M: 9 heads and 3 KV heads, so 3 ranks hold 3 heads and 1 KV head each.
    assert_same_results(run(default_model_dir, 1)[0], run(default_model_dir, 3)[0])
