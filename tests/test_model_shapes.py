"""The random-weight model shapes of benchmarks and the GPU device check (sgl_lite/runtime/model_executor/model_shapes.py)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from sgl_lite.runtime.model_executor.model_shapes import SHAPES, parameter_count, random_model_dir


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_parameter_count_is_what_transformers_builds(shape: str) -> None:
    config = transformers.LlamaConfig(vocab_size=49152, **SHAPES[shape])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert parameter_count(shape) == sum(p.numel() for p in model.parameters())


def test_a_random_model_serves_with_the_tokenizer_it_was_given(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    """A shape written beside a tokenizer loads in sgl_lite and tokenizes as that tokenizer does; a second call
    reuses the folder. (A small shape is swapped in: the real ones take seconds to write.)"""
    from sgl_lite.runtime.server.engine import Engine

    monkeypatch.setitem(SHAPES, "test", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, tie_word_embeddings=True))
    out = random_model_dir("test", tiny_llama_dir, tmp_path / "random-test", dtype="float32")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert (out / "tokenizer.json").read_text() == (tiny_llama_dir / "tokenizer.json").read_text()
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert random_model_dir("test", tiny_llama_dir, out) == out and (out / "model.safetensors").stat().st_mtime_ns == written
    with Engine(str(out), dtype="float32", max_total_tokens=256, log_level="warning") as engine:
        result = engine.generate("hello world", {"max_new_tokens": 3, "temperature": 0})
    assert len(result["output_ids"]) == 3
    with pytest.raises(ValueError, match="unknown model shape"):
        random_model_dir("7t", tiny_llama_dir, tmp_path / "nope")


def test_random_shapes_are_model_paths(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    """`--model-path random-<shape>` writes the shape once into the cache with the default model's tokenizer."""
    from sgl_lite.runtime.model_executor import loader

    monkeypatch.setenv("SGL_LITE_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "DEFAULT_MODEL", str(tiny_llama_dir))
    monkeypatch.setitem(SHAPES, "test", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, tie_word_embeddings=True))
    folder = loader.resolve_model_path("random-test")
    assert folder == tmp_path / "models" / "random-test" and (folder / "model.safetensors").exists()
    assert (folder / "tokenizer.json").read_text() == (tiny_llama_dir / "tokenizer.json").read_text()
    with pytest.raises(loader.LoaderError, match="random-1.7b"):
        loader.resolve_model_path("random-70t")
