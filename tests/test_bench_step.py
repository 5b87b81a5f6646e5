"""scripts/bench_step.py on a tiny random model: the step split is complete and the runtime is left clean."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_step.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phases_split_each_step(tiny_llama_dir: Path) -> None:
    bench = load_script()
    model = tiny_llama_dir
    core = bench.build_core(str(model), "float32", pool_tokens=512, max_running=4)
    timer = bench.PhaseTimer()
    timer.wrap(core.runner, "forward", "forward")
    timer.wrap(core.runner.model, "forward", "model")
    timer.wrap(core.runner.model, "compute_logits", "LM head")
    timer.wrap(core.runner.sampler, "sample", "sampling")
    row = bench.measure_batch(core, timer, batch=3, prompt_len=16, steps=4, seed=0)
    assert row["steps"] == 4
    for phase in bench.PHASES:
        assert row[phase] >= 0.0, phase
    # the model ran inside every timed step: a wrapper that never fired would leave it at 0
    assert row["model"] > 0.0 and row["LM head"] > 0.0 and row["sampling"] > 0.0
    # medians of parts need not add up exactly, but no part can exceed the step
    assert max(row[p] for p in bench.PHASES) <= row["wall"]
    # measure_batch drained the scheduler: every slot and row is back
    assert not core.scheduler.has_work()
    assert core.runner.req_to_token.available_size == core.runner.req_to_token.max_requests
    assert bench.measure_baseline(core.runner, batch=3, prompt_len=16, steps=2) > 0.0


def test_main_writes_json(tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_script()
    model = tiny_llama_dir
    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["bench_step.py", "--model", str(model), "--dtype", "float32", "--batch-sizes", "2,1",
                                      "--steps", "3", "--prompt-len", "8", "--out", str(out)])
    bench.main()
    results = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in results] == [2, 1]
    assert all(0.0 <= r["sched_prep_share"] <= 1.0 for r in results)
