"""scripts/bench_responses.py's pure parts (the seeded workload, the per-mode figures, the same-turn count) and the
server CPU accounting it reuses from bench_peers.py."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_responses")


def test_seeded_text_has_the_asked_length_and_depends_only_on_its_seed(bench) -> None:
    for chars in (1, 7, 300, 1500):
        assert len(bench.seeded_text("0:1:2", chars)) == chars
    assert bench.seeded_text("0:1:2", 500) == bench.seeded_text("0:1:2", 500)
    assert bench.seeded_text("0:1:2", 500) != bench.seeded_text("0:1:3", 500)
    assert bench.seeded_text("0:1:2", 0) == ""


def test_workload_sends_the_task_first_then_one_tool_result_per_turn(bench) -> None:
    work = bench.make_workload(sessions=3, turns=4, obs_chars=50, system_chars=20, seed=5)
    assert work == bench.make_workload(sessions=3, turns=4, obs_chars=50, system_chars=20, seed=5)
    assert len(set(work.tasks)) == 3 and all(len(obs) == 4 for obs in work.observations)
    assert work.new_input(2, 0) == [work.tasks[2], work.observations[2][0]]
    assert work.new_input(2, 3) == [work.observations[2][3]]
    # sessions differ from one another, and a turn's tool result from the session's other turns
    assert work.observations[0][0] != work.observations[1][0]
    assert len({*work.observations[1]}) == 4


def _record(session: int, turn: int, sent: int, prompt: int, cached: int, output: int, e2e: float, text: str = "x") -> dict:
    return {"session": session, "turn": turn, "sent_bytes": sent, "prompt_tokens": prompt, "cached_tokens": cached,
            "output_tokens": output, "e2e_s": e2e, "text": text}


def test_summarize_divides_by_turns_and_wall_time(bench) -> None:
    records = [_record(0, 0, 100, 40, 0, 8, 1.0), _record(0, 1, 300, 80, 40, 6, 3.0),
               _record(1, 0, 120, 40, 30, 8, 2.0), _record(1, 1, 500, 90, 50, 4, 5.0)]
    row = bench.summarize("chat", records, wall_s=4.0, server_cpu_s=2.0)
    assert row["turns"] == 4
    assert row["sent_bytes_per_turn"] == pytest.approx((100 + 300 + 120 + 500) / 4)
    assert row["sent_bytes_last_turn"] == pytest.approx((300 + 500) / 2)  # turn 1 of each session
    assert row["server_cpu_s_per_turn"] == pytest.approx(2.0 / 4)
    assert row["output_tok_s"] == pytest.approx((8 + 6 + 8 + 4) / 4.0)
    assert row["e2e_p50_s"] == pytest.approx((2.0 + 3.0) / 2)
    assert row["cached_share"] == pytest.approx((0 + 40 + 30 + 50) / (40 + 80 + 40 + 90))


def test_same_turns_needs_the_same_prompt_and_output_of_the_same_session_turn(bench) -> None:
    a = [_record(0, 0, 1, 40, 0, 1, 1.0, "a"), _record(0, 1, 1, 60, 0, 1, 1.0, "b"), _record(1, 0, 1, 40, 0, 1, 1.0, "c")]
    b = [_record(1, 0, 9, 40, 5, 1, 2.0, "c"), _record(0, 0, 9, 40, 5, 1, 2.0, "a"), _record(0, 1, 9, 61, 0, 1, 1.0, "b")]
    assert bench.same_turns(a, b) == 2  # (0, 1) has another prompt length; order and timing do not matter
    b[0]["text"] = "d"
    assert bench.same_turns(a, b) == 1


# The parent starts a child in a session of its own (as the HTTP front is), which burns CPU, then both wait.
_TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile time.process_time() < 0.4: pass\\nprint('done', flush=True)\\ntime.sleep(60)"],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def test_group_cpu_seconds_counts_descendants_in_sessions_of_their_own() -> None:
    peers = load_script("bench_peers")
    parent = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = None
    try:
        pid, said = parent.stdout.readline().split()
        child = int(pid)
        assert said == "done"
        time.sleep(0.1)  # the kernel's tick accounting settles
        assert peers.group_cpu_seconds(parent.pid) >= 0.35
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
