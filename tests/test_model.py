"""The Llama-family model and ModelRunner against transformers on the same weights (float32).

The runner is driven directly with hand-built ForwardBatch + Req objects and a SlotAllocator, as
the scheduler would: allocate slots for the new tokens, write them into the request's
req_to_token row, run, append the sampled token.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.memory_pool import SlotAllocator
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch
from sgl_lite.runtime.model_executor.model_runner import ModelRunner, choose_dtype, cpu_has_bf16_kernels
from sgl_lite.runtime.models.llama import LlamaForCausalLM
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.testing.hf_reference import hf_greedy, hf_model
from sgl_lite.testing.tiny_model import make_tiny_model

LOGIT_ATOL = 1e-4  # fp32, same weights, different op order
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64, "rope_theta": 10000.0}


class Driver:
    """A minimal scheduler stand-in: owns slots and rows, builds ForwardBatches, greedy-decodes."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.alloc = SlotAllocator(runner.num_slots)

    def new_req(self, rid: str, ids: list[int], max_new_tokens: int = 16, **kw) -> Req:
        req = Req(rid=rid, input_ids=list(ids), sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), **kw)
        req.req_pool_idx = self.runner.req_to_token.alloc()
        return req

    def step(self, reqs: list[Req], extend_lens: list[int], sample: list[bool] | None = None) -> list[int | None]:
        prefix_lens = [r.kv_len for r in reqs]
        slots = self.alloc.alloc(sum(extend_lens))
        assert slots is not None
        offset = 0
        for req, prefix, extend in zip(reqs, prefix_lens, extend_lens):
            self.runner.req_to_token.table[req.req_pool_idx, prefix : prefix + extend] = slots[offset : offset + extend]
            offset += extend
        if sample is None:
            sample = [r.kv_len + e >= len(r.input_ids) for r, e in zip(reqs, extend_lens)]
        batch = ForwardBatch(reqs=reqs, prefix_lens=prefix_lens, extend_lens=extend_lens, out_cache_loc=slots,
                             sample=sample, is_decode=all(e == 1 for e in extend_lens))
        out = self.runner.forward(batch)
        for req, extend, tok in zip(reqs, extend_lens, out.next_token_ids):
            req.kv_len += extend
            if tok is not None:
                req.output_ids.append(tok)
        return out.next_token_ids

    def generate(self, reqs: list[Req], num_new: int, chunk: int | None = None) -> list[list[int]]:
        """Prefill all (optionally in chunks of `chunk` tokens), then decode the batch together."""
        while any(r.kv_len < len(r.input_ids) for r in reqs):
            todo = [r for r in reqs if r.kv_len < len(r.input_ids)]
            self.step(todo, [min(len(r.input_ids) - r.kv_len, chunk or 10**9) for r in todo])
        while any(len(r.output_ids) < num_new for r in reqs):
            todo = [r for r in reqs if len(r.output_ids) < num_new]
            self.step(todo, [1] * len(todo))
        return [r.output_ids[:num_new] for r in reqs]


def make_runner(path: Path, dtype: str = "float32", max_total_tokens: int = 4096, keep_dense_weights: bool = False) -> ModelRunner:
    args = ServerArgs(model_path=str(path), dtype=dtype, device="cpu", max_total_tokens=max_total_tokens, max_running_requests=16)
    return ModelRunner(args, model_dir=path, keep_dense_weights=keep_dense_weights)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "llama3_rope", "untied"])
def tiny(request, tmp_path_factory):
    # qwen3: per-head q/k norms, and a head_dim (32) other than hidden_size / heads (16)
    kw = {"llama": {}, "qwen2": {"arch": "qwen2"}, "qwen3": {"arch": "qwen3", "head_dim": 32},
          "llama3_rope": {"rope_scaling": LLAMA3_SCALING}, "untied": {"tie_word_embeddings": False}}[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), **kw)
    return path, make_runner(path), hf_model(path)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_greedy_matches_transformers(tiny):
    path, runner, ref = tiny
    (ids,) = prompts(runner.vocab_size, [11])
    driver = Driver(runner)
    ours = driver.generate([driver.new_req("a", ids)], 40)[0]
    assert ours == hf_greedy(ref, ids, 40)


def test_batch_of_different_lengths_matches(tiny):
    path, runner, ref = tiny
    driver = Driver(runner)
    batch = prompts(runner.vocab_size, [5, 17, 1, 30], seed=1)
    ours = driver.generate([driver.new_req(str(i), p) for i, p in enumerate(batch)], 12)
    assert ours == [hf_greedy(ref, p, 12) for p in batch]


def test_prefill_logits_close(tiny):
    path, runner, ref = tiny
    driver = Driver(runner)
    ids = prompts(runner.vocab_size, [23], seed=2)[0]
    req = driver.new_req("a", ids, return_logprob=True, logprob_start_len=0)
    driver.step([req], [len(ids)])
    with torch.no_grad():
        ref_logprobs = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
    expected = ref_logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(req.input_token_logprobs)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < LOGIT_ATOL
    assert abs(req.output_token_logprobs[0] - ref_logprobs[-1].max().item()) < LOGIT_ATOL


def test_chunked_and_prefix_reuse_match(tiny):
    path, runner, ref = tiny
    driver = Driver(runner)
    shared, tail = prompts(runner.vocab_size, [20, 9], seed=3)
    expected = hf_greedy(ref, shared + tail, 10)
    # chunked prefill: 7-token chunks, with input logprobs spanning the chunk boundaries
    req = driver.new_req("chunked", shared + tail, return_logprob=True, logprob_start_len=0)
    assert driver.generate([req], 10, chunk=7)[0] == expected
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(torch.tensor([shared + tail])).logits[0], -1)
    ids = shared + tail
    exp_lp = ref_lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (torch.tensor(req.input_token_logprobs) - exp_lp).abs().max() < LOGIT_ATOL
    # prefix reuse: a first request computes `shared`; a second one reuses its slots
    first = driver.new_req("first", shared)
    driver.step([first], [len(shared)], sample=[False])
    second = driver.new_req("second", shared + tail)
    table = runner.req_to_token.table
    table[second.req_pool_idx, : len(shared)] = table[first.req_pool_idx, : len(shared)]
    second.kv_len = len(shared)
    assert driver.generate([second], 10)[0] == expected


def test_load_weights_names_missing_and_unexpected(tiny):
    path, runner, ref = tiny
    weights = dict(ref.state_dict())
    model: LlamaForCausalLM = type(runner.model)(runner.config, torch.float32, "cpu")
    missing = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="missing.*layers.1.qkv_weight"):
        model.load_weights(missing.items())
    with pytest.raises(ValueError, match="unexpected.*model.layers.0.bogus.weight"):
        model.load_weights([*weights.items(), ("model.layers.0.bogus.weight", torch.zeros(1))])
    bad = dict(weights)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        model.load_weights(bad.items())


def test_choose_dtype():
    assert choose_dtype("float32", torch.device("cpu")) == torch.float32
    assert choose_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    flags = open("/proc/cpuinfo").read()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    ours = cpu_has_bf16_kernels()  # sgl_lite's AVX2 kernels make bf16 the fast path without native bf16
    assert ours == bool(re.search(r"\bavx2\b", flags) and re.search(r"\bfma\b", flags))
    assert choose_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native or ours else torch.float32)
    # a model on torch's kernels alone (the transformers baseline) gets bf16 only from native instructions
    assert choose_dtype("auto", torch.device("cpu"), own_kernels=False) == (torch.bfloat16 if native else torch.float32)


def test_kv_pool_sized_from_memory(tiny_llama_dir):
    path = tiny_llama_dir
    runner = ModelRunner(ServerArgs(model_path=str(path), dtype="float32", device="cpu", context_length=256), model_dir=path)
    assert 0 < runner.num_slots <= 64 * 256
    assert runner.kv_pool.total_bytes == runner.kv_cache_summary()["bytes"]
    assert 1 <= runner.max_running_requests <= 256
    with pytest.raises(ValueError, match="context-length"):
        ModelRunner(ServerArgs(model_path=str(path), dtype="float32", context_length=10**6), model_dir=path)


@pytest.fixture(scope="module")
def default_model(default_model_dir):
    """(runner, transformers model) on the default model in float32, loaded once for this module."""
    return make_runner(default_model_dir, max_total_tokens=256), hf_model(default_model_dir)


@pytest.mark.default_model
def test_default_model_greedy_matches_transformers(default_model):
    # Two prompts prefilled in chunks (crossing a chunk boundary) and decoded together: 32 greedy
    # tokens each. Equal lengths let transformers decode both in one unpadded batch, so the test
    # costs ~32 transformers steps plus ~34 of ours (each step streams the 0.5 GB of fp32 weights).
    runner, ref = default_model
    driver = Driver(runner)
    batch = prompts(runner.vocab_size, [19, 19], seed=4)
    ours = driver.generate([driver.new_req(str(i), p) for i, p in enumerate(batch)], 32, chunk=12)
    with torch.no_grad():
        expected = ref.generate(torch.tensor(batch), attention_mask=torch.ones(2, 19, dtype=torch.int64), max_new_tokens=32,
                                min_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert ours == expected[:, 19:].tolist()


def test_new_token_ids_slices_fill_ids():
    from sgl_lite.runtime.model_executor.model_runner import _new_token_ids

    req = Req(rid="r", input_ids=[1, 2, 3, 4], sampling_params=SamplingParams())
    req.output_ids = [5, 6, 7]
    for prefix in range(7):
        for extend in range(1, 8 - prefix):
            assert _new_token_ids(req, prefix, extend) == req.fill_ids[prefix : prefix + extend]


def test_logprob_start_and_bad_batch(tiny):
    path, runner, ref = tiny
    driver = Driver(runner)
    ids = prompts(runner.vocab_size, [15], seed=5)[0]
    req = driver.new_req("a", ids, return_logprob=True, logprob_start_len=6, top_logprobs_num=3)
    assert driver.step([req], [len(ids)]) != [None]
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0], -1)
    expected = ref_lp[torch.arange(5, len(ids) - 1), torch.tensor(ids[6:])]
    assert (torch.tensor(req.input_token_logprobs) - expected).abs().max() < LOGIT_ATOL
    top = ref_lp[-1].topk(3)
    assert [t for t, _ in req.output_top_logprobs[0]] == top.indices.tolist()
    # a prefill-only request samples nothing
    hint = driver.new_req("hint", ids)
    assert driver.step([hint], [len(ids)], sample=[False]) == [None]
    bad = driver.new_req("bad", ids[:3])
    with pytest.raises(ValueError, match="request bad"):
        runner.forward(ForwardBatch(reqs=[bad], prefix_lens=[0], extend_lens=[5], out_cache_loc=torch.arange(1, 6), sample=[True]))


def test_bf16_packed_weights_match_plain_linear(tiny_llama_dir):
    from sgl_lite.runtime.models.llama import cpu_packed_linear_supported

    if not cpu_packed_linear_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN bf16 linear in this torch build")
    path = tiny_llama_dir
    runner = make_runner(path, dtype="bfloat16", keep_dense_weights=True)
    assert runner.packed_weights
    ids = prompts(runner.vocab_size, [9], seed=6)[0]

    def logprobs() -> list[float]:
        driver = Driver(runner)
        req = driver.new_req("a", ids, return_logprob=True, logprob_start_len=0)
        driver.step([req], [len(ids)])
        runner.req_to_token.free(req.req_pool_idx)
        return req.input_token_logprobs

    from sgl_lite.runtime.layers.linear import GemvLinear, gemv_supported

    if gemv_supported(runner.model.layers[0].qkv_weight):  # the 9-row prefill goes through the small-row kernel
        assert all(isinstance(form, GemvLinear) for layer in runner.model.layers for form in layer.packed.values())
    packed = logprobs()
    for layer in runner.model.layers:
        layer.packed = dict.fromkeys(layer.packed)
    runner.model.packed_lm_head = None
    assert torch.allclose(torch.tensor(packed), torch.tensor(logprobs()), atol=1e-2)


def test_the_runtime_frees_the_weights_its_packed_forms_make_unread(tiny_llama_dir):
    """A weight whose packed forms take every call is only its shape in the runtime's model (a meta tensor: a
    call that reached it would fail, not read garbage); the tokens are those of a runner that kept it."""
    from sgl_lite.runtime.layers.linear import reads_dense_weight

    ids = prompts(256, [40, 7], seed=8)

    def greedy(runner: ModelRunner) -> list[list[int]]:
        driver = Driver(runner)
        return driver.generate([driver.new_req(str(i), p) for i, p in enumerate(ids)], 5)

    kept = make_runner(tiny_llama_dir, dtype="bfloat16", keep_dense_weights=True)
    freed = make_runner(tiny_llama_dir, dtype="bfloat16")
    for layer in freed.model.layers:
        for name, form in layer.packed.items():
            weight = getattr(layer, f"{name}_weight")
            assert (weight.device.type == "meta") == (not reads_dense_weight(form)), name
            assert weight.shape == getattr(kept.model.layers[layer.layer_id], f"{name}_weight").shape
    assert all(getattr(layer, f"{name}_weight").device.type == "cpu" for layer in kept.model.layers for name in layer.packed)
    assert greedy(freed) == greedy(kept)
