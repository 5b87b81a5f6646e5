"""Engine end to end on a tiny random model (and one test on the real default model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sgl_lite.runtime.server.engine import Engine
from sgl_lite.testing.hf_reference import hf_greedy, hf_model


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path):
    eng = Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, max_running_requests=16,
                 dtype="float32", device="cpu", chunked_prefill_size=64)
    yield eng
    eng.shutdown()
    eng.core.scheduler.check_invariant()


@pytest.fixture(autouse=True)
def _invariant(engine: Engine):
    yield
    engine.core.scheduler.check_invariant()
    assert not engine.core.scheduler.has_work()


GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def test_greedy_matches_transformers_and_cache_hit_keeps_it(engine: Engine, tiny_llama_dir: Path) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. What is the capital of France?"
    first = engine.generate(prompt, GREEDY)
    ids = engine.core.tokenizer(prompt)["input_ids"]
    assert first["output_ids"] == hf_greedy(hf_model(tiny_llama_dir), ids, 12)
    assert first["text"] == engine.core.tokenizer.decode(first["output_ids"], skip_special_tokens=True)
    second = engine.generate(prompt, GREEDY)
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["output_ids"] == first["output_ids"]
    meta = second["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length"} and meta["e2e_latency"] >= 0


def test_batch_generate_keeps_order_and_matches_single(engine: Engine, capsys: pytest.CaptureFixture) -> None:
    prompts = [f"Thought: I should call a tool number {i}." for i in range(33)]
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    outs = engine.generate(prompts, params)
    assert isinstance(outs, list) and len(outs) == 33
    assert "generate" in capsys.readouterr().err  # the progress bar for a large list
    for i in (0, 32):
        assert engine.generate(prompts[i], params)["output_ids"] == outs[i]["output_ids"]


def test_invalid_sampling_params_name_the_field(engine: Engine) -> None:
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("hi", {"temperature": -1})
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(["a", "b"], [{"max_new_tokens": 2}, {"top_p": 0}])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate("hi", {"max_tokens": 3})
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": 10**6})
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()


def test_stop_string_trimmed_unless_no_stop_trim(engine: Engine) -> None:
    prompt = "Paris is the capital of"
    free = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    text = free["text"]
    stop = text[3:6]
    assert stop and text.find(stop) >= 0
    cut = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop": stop})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.find(stop)]
    kept = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop": stop, "no_stop_trim": True})
    assert kept["text"].startswith(cut["text"] + stop)  # the stop may end inside the last token


def test_prefill_only_and_logprobs(engine: Engine) -> None:
    prompt = "def add(a, b): return a + b  # numbers 0 1 2 3"
    hint = engine.generate(prompt, {"max_new_tokens": 0})
    assert hint["output_ids"] == [] and hint["text"] == "" and hint["meta_info"]["finish_reason"] == {"type": "length"}
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                          return_logprob=True, logprob_start_len=2, top_logprobs_num=2)
    meta = out["meta_info"]
    n = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == n - 2
    assert meta["cached_tokens"] <= 1
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 and extra is None for lp, _, extra in meta["output_token_logprobs"])
    assert len(meta["output_top_logprobs"]) == 3 and all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_stream_chunks_are_sglangs(engine: Engine) -> None:
    # SGLang's Engine.generate(stream=True): each chunk holds the text and ids so far (not a delta),
    # with a meta_info; the last chunk is the whole output.
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    whole = engine.generate("Berlin is the capital of", params)
    chunks = list(engine.generate("Berlin is the capital of", params, stream=True))
    assert len(chunks) > 2
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert all(c["meta_info"]["completion_tokens"] == len(c["output_ids"]) for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length"}


def test_stream_never_sends_a_stop_string_prefix_the_final_text_cuts(engine: Engine) -> None:
    prompt = "Berlin is the capital of"
    free = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    decode = engine.core.decode
    ids = free["output_ids"]
    # A stop string made of the text of two output tokens, whose first part arrives a step before
    # the token that completes it: a stream that re-decodes each step sends that part, then the
    # final text cuts it.
    def stop_at(k: int) -> str:  # the text of tokens k and k + 1
        return decode(ids[: k + 2])[len(decode(ids[:k])):]

    start = next(k for k in range(1, len(ids) - 2)
                 if len(decode(ids[: k + 1])) > len(decode(ids[:k])) and not stop_at(k).endswith("\ufffd")
                 and len(stop_at(k)) > len(decode(ids[: k + 1])) - len(decode(ids[:k]))
                 and stop_at(k) not in decode(ids[: k + 1]))
    stop = stop_at(start)
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop": [stop]}
    chunks = list(engine.generate(prompt, params, stream=True))
    final = engine.generate(prompt, params)
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # Chunks hold the text so far (SGLang's Engine shape): each must be a prefix of the final text,
    # and the last one is the final text.
    for chunk in chunks:
        assert final["text"].startswith(chunk["text"]), \
            f"streamed {chunk['text']!r}, which the final text {final['text']!r} does not start with"
    assert chunks[-1]["text"] == final["text"] == decode(ids[:start])
    assert chunks[-1]["output_ids"] == final["output_ids"]


def test_constrained_request_waits_for_its_grammar(engine: Engine) -> None:
    out = engine.generate("The number is", {"temperature": 0, "max_new_tokens": 10, "regex": "[0-9]{3}"})
    assert len(out["text"]) == 3 and out["text"].isdigit()
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    with pytest.raises(ValueError, match="regex"):
        engine.generate("x", {"regex": "[0-9"})


def test_server_info_and_flush(engine: Engine) -> None:
    info = engine.get_server_info()
    for key in ("model_path", "context_length", "vocab_size", "eos_token_ids", "num_waiting", "slots_total", "server_args"):
        assert key in info
    assert engine.flush_cache()
    assert engine.get_server_info()["slots_evictable"] == 0


@pytest.mark.default_model
def test_default_model_second_prompt_hits_cache(default_model_dir: Path) -> None:
    with Engine(model_path=str(default_model_dir), max_total_tokens=2048, max_running_requests=4) as eng:
        prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        params = {"temperature": 0, "max_new_tokens": 6}
        first = eng.generate(prompt, params)
        assert first["meta_info"]["cached_tokens"] == 0
        again = eng.generate(prompt, params)
        assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
        assert again["output_ids"] == first["output_ids"]
        eng.core.scheduler.check_invariant()


def test_sampler_and_stop_check_share_one_eos_set(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """min_new_tokens keeps exactly the EOS ids from being sampled that the stop check ends on: the
    model config's and the tokenizer's, resolved once at startup (here they differ)."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    config["eos_token_id"] = tokenizer_eos + 1
    (model_dir / "config.json").write_text(json.dumps(config))
    with Engine(model_path=str(model_dir), max_total_tokens=512, dtype="float32", device="cpu") as eng:
        sampler_eos = set(eng.core.runner.sampler.eos_token_ids)
        assert sampler_eos == set(eng.core.scheduler.stop_checker.eos_token_ids) == {tokenizer_eos, tokenizer_eos + 1}
