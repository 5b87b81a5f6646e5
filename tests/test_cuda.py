"""The CUDA path, run where a GPU is (scripts/gpu/device_check.sh on a lent H100/H200; skipped elsewhere).

FlashInfer against torch_native on random paged batches (decode, ragged extend over cached prefixes, GQA,
several batch sizes, bf16 and fp8 pools); decode steps replayed from CUDA graphs against eager ones; the
Engine on CUDA: greedy tokens of the default model against the CPU float32 path, cache hits that change
nothing, seeded sampling, a regex grammar's bitmask, retraction with a pool too small for the batch, an
abort mid-decode, and the KV accounting invariant after each.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from sgl_lite.runtime.layers.attention import TorchNativeBackend
from sgl_lite.runtime.mem_cache.memory_pool import KVPool

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")
# bf16 inputs, float64 reference within bf16 rounding of q, k, probabilities and output (test_attention.py's).
BF16_ATOL = 3e-2
# FlashInfer's prefill over an 8-bit pool multiplies the probabilities by V in that format (3 mantissa bits in
# e4m3: up to 2^-4 relative per probability), so outputs of magnitude ~2-3 move by up to ~0.2 (docs/gpu.md); a
# wrong index or mask moves them by the values' own size, ~1.
FP8_PREFILL_ATOL = 0.25
BATCHES = {
    "decode_gqa3": ([3, 60, 17, 1, 41, 8], [1, 1, 1, 1, 1, 1], 9, 3, 64),
    "decode_64": ([int(x) for x in torch.randint(1, 300, (64,), generator=torch.Generator().manual_seed(5))], [1] * 64, 9, 3, 64),
    "prefill": ([0, 0, 0], [40, 7, 129], 9, 3, 64),
    "extend_over_prefix": ([33, 200, 5, 12], [17, 64, 3, 1], 9, 3, 64),
    "extend_mha128": ([100, 0], [30, 50], 8, 8, 128),
}


def _on_cuda(pool: KVPool, meta, *tensors: torch.Tensor):
    pool.k = [t.to(CUDA) for t in pool.k]
    pool.v = [t.to(CUDA) for t in pool.v]
    moved = {f.name: getattr(meta, f.name).to(CUDA) for f in dataclasses.fields(meta) if isinstance(getattr(meta, f.name), torch.Tensor)}
    return pool, dataclasses.replace(meta, **moved), *(t.to(CUDA) for t in tensors)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("case", sorted(BATCHES))
def test_flashinfer_matches_torch_native(case: str, kv_dtype: torch.dtype) -> None:
    from test_attention import random_batch

    from sgl_lite.runtime.layers.attention.flashinfer import FlashInferBackend

    prefix_lens, extend_lens, hq, hkv, dim = BATCHES[case]
    pool, meta, q, k, v = random_batch(7, prefix_lens, extend_lens, hq, hkv, d=dim, dtype=torch.bfloat16)
    if kv_dtype != torch.bfloat16:
        stored = KVPool(2, pool.num_slots, hkv, dim, kv_dtype)
        for layer in range(2):
            stored.k[layer].copy_(pool.k[layer].nan_to_num().to(kv_dtype))
            stored.v[layer].copy_(pool.v[layer].nan_to_num().to(kv_dtype))
        pool = stored
    pool, meta, q, k, v = _on_cuda(pool, meta, q, k, v)
    flashinfer, native = FlashInferBackend(hq, hkv, dim, device=CUDA), TorchNativeBackend(hq, hkv, dim)
    for backend in (flashinfer, native):
        backend.prepare(meta)
    for layer in range(2):
        got = flashinfer.forward(layer, q, k, v, pool)
        expected = native.forward(layer, q, k, v, pool)
        assert torch.isfinite(got).all()
        assert (got.float() - expected.float()).abs().max().item() < (BF16_ATOL if kv_dtype == torch.bfloat16 else FP8_PREFILL_ATOL)


@pytest.fixture(scope="module")
def cuda_model_dir(request: pytest.FixtureRequest) -> str:
    """The default model, or (SGL_LITE_CUDA_MODEL) a folder of its shape with random weights: the GPU machine
    cannot fetch the default model, and its weights are too big to carry there."""
    return os.environ.get("SGL_LITE_CUDA_MODEL") or str(request.getfixturevalue("default_model_dir"))


@pytest.fixture(scope="module")
def cuda_engine(cuda_model_dir):
    from sgl_lite.runtime.server.engine import Engine

    engine = Engine(cuda_model_dir, device="cuda", dtype="bfloat16", max_total_tokens=8192, log_level="warning")
    yield engine
    engine.shutdown()


PROMPTS = [f"Question {i}: what is {i} plus {i + 3}? Answer briefly." for i in range(20)]
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def test_greedy_tokens_match_the_cpu_float32_path(cuda_engine, cuda_model_dir) -> None:
    """bf16 on the GPU and float32 on the CPU round differently, so a near tie may go either way (random
    weights make near ties common): every first token the GPU picks must be one the CPU float32 path scores
    within bf16's tolerance of its best, and at least half must be the CPU's own pick (a wrong kernel's
    picks are neither)."""
    from sgl_lite.runtime.server.engine import Engine

    gpu = [o["output_ids"][0] for o in cuda_engine.generate(PROMPTS, {"max_new_tokens": 1, "temperature": 0})]
    with Engine(cuda_model_dir, device="cpu", dtype="float32", max_total_tokens=4096, log_level="warning") as cpu_engine:
        cpu = cpu_engine.generate(PROMPTS, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, top_logprobs_num=20)
    same = 0
    for token, reference in zip(gpu, cpu):
        top = {tok: lp for lp, tok, _ in reference["meta_info"]["output_top_logprobs"][0]}
        best = max(top.values())
        assert token in top and top[token] >= best - 0.15, (token, sorted(top.items(), key=lambda kv: -kv[1])[:3])
        same += token == reference["output_ids"][0]
    assert same >= len(PROMPTS) // 2, same


def _idle_without_leaks(engine) -> None:
    engine.core.scheduler.check_invariant()
    assert not engine.core.scheduler.has_work()


def test_a_cache_hit_changes_no_result_on_cuda(cuda_engine) -> None:
    cuda_engine.flush_cache()
    cold = cuda_engine.generate(PROMPTS[:8], GREEDY)
    warm = cuda_engine.generate(PROMPTS[:8], GREEDY)
    assert all(w["meta_info"]["cached_tokens"] > 0 for w in warm)
    assert [c["output_ids"] for c in cold] == [w["output_ids"] for w in warm]
    _idle_without_leaks(cuda_engine)


def test_retraction_on_cuda_loses_no_request(cuda_model_dir) -> None:
    """A pool too small for every request to finish together: some are retracted and run again, all finish."""
    from sgl_lite.runtime.server.engine import Engine

    with Engine(cuda_model_dir, device="cuda", dtype="bfloat16", max_total_tokens=600, log_level="warning") as engine:
        outs = engine.generate([p * 3 for p in PROMPTS[:12]], {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
        assert [len(o["output_ids"]) for o in outs] == [48] * 12
        _idle_without_leaks(engine)


def test_seeded_sampling_repeats_on_cuda(cuda_engine) -> None:
    """Sampling draws from each request's own generator on the GPU: the same seed gives the same tokens. Each run
    starts from an empty cache: a cached prefix's extend rounds differently from a whole prefill in bf16, and on a
    random model's near-flat distribution that moves an inverse-CDF pick."""
    params = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95, "ignore_eos": True}

    def sampled(seed: int) -> list[dict]:
        cuda_engine.flush_cache()
        return cuda_engine.generate(PROMPTS[:4], dict(params, sampling_seed=seed))

    first, again, other = sampled(7), sampled(7), sampled(8)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert [o["output_ids"] for o in first] != [o["output_ids"] for o in other]
    _idle_without_leaks(cuda_engine)


def test_a_grammar_constrains_decoding_on_cuda(cuda_engine) -> None:
    """The grammar's token bitmask is applied to logits on the GPU: the output is exactly what the regex allows."""
    outs = cuda_engine.generate(PROMPTS[:3], {"temperature": 0, "max_new_tokens": 10, "regex": "[0-9]{3}"})
    for out in outs:
        assert len(out["text"]) == 3 and out["text"].isdigit(), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    _idle_without_leaks(cuda_engine)


def test_an_abort_mid_decode_frees_its_kv_on_cuda(cuda_engine) -> None:
    """A stream closed after a few chunks aborts its request (Engine._stream): its KV comes back."""
    stream = cuda_engine.generate("Count slowly:", {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}, stream=True)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    _idle_without_leaks(cuda_engine)


def test_cuda_graph_replay_matches_eager(cuda_model_dir) -> None:
    """Decode steps replayed from captured graphs (5 requests, padded to the 8-row bucket) give the eager
    FlashInfer step's logprobs on the same inputs: each graph pick within bf16's tolerance of the eager best
    (the graph's attention plan may split the KV differently), and padding rows disturb no real row."""
    from sgl_lite.runtime.managers.request import Req
    from sgl_lite.runtime.mem_cache.memory_pool import SlotAllocator
    from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch
    from sgl_lite.runtime.model_executor.model_runner import ModelRunner
    from sgl_lite.runtime.protocol import SamplingParams
    from sgl_lite.runtime.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(model_path=cuda_model_dir, device="cuda", dtype="bfloat16", max_total_tokens=4096,
                                    max_running_requests=16, cuda_graph_max_bs=16, log_level="warning"))
    graphs = runner.graph_runner
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
    alloc, g = SlotAllocator(runner.num_slots), torch.Generator().manual_seed(0)
    reqs = []
    for i, n in enumerate([5, 40, 17, 120, 3]):
        req = Req(rid=str(i), input_ids=torch.randint(1000, 40000, (n,), generator=g).tolist(),
                  sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0), return_logprob=True, top_logprobs_num=5)
        req.req_pool_idx = runner.req_to_token.alloc()
        reqs.append(req)

    def batch(extend_lens: list[int]) -> ForwardBatch:
        slots = alloc.alloc(sum(extend_lens))
        offset = 0
        for req, extend in zip(reqs, extend_lens):
            runner.req_to_token.table[req.req_pool_idx, req.kv_len : req.kv_len + extend] = slots[offset : offset + extend]
            offset += extend
        return ForwardBatch(reqs=reqs, prefix_lens=[r.kv_len for r in reqs], extend_lens=extend_lens, out_cache_loc=slots,
                            sample=[True] * len(reqs), is_decode=all(e == 1 for e in extend_lens))

    def advance(step: ForwardBatch, tokens: list[int]) -> None:
        for req, extend, token in zip(reqs, step.extend_lens, tokens):
            req.kv_len += extend
            req.output_ids.append(token)

    prefill = batch([len(r.input_ids) for r in reqs])
    advance(prefill, runner.forward(prefill).next_token_ids)
    for _ in range(3):
        step = batch([1] * len(reqs))
        replayed = runner.forward(step).next_token_ids
        graph_top = [dict((tok, lp) for tok, lp in r.output_top_logprobs[-1]) for r in reqs]
        runner.graph_runner = None
        eager = runner.forward(step).next_token_ids
        runner.graph_runner = graphs
        for token, req, top in zip(replayed, reqs, graph_top):
            eager_top = dict((tok, lp) for tok, lp in req.output_top_logprobs[-1])
            best = max(eager_top.values())
            assert token in eager_top and eager_top[token] >= best - 0.15, (token, eager_top)
            assert abs(max(top.values()) - best) < 0.15
        advance(step, eager)
