"""scripts/ab_*_builds.py end to end, at their smallest settings: each builds its kernel as it is at HEAD and in the
working tree, times both, prints one table row per case and writes both builds' timings to JSON.

They need git (the base build's sources come from `git show`): skipped outside a git checkout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def git_checkout() -> None:
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: the scripts build the base version from git")


def run_ab(script: str, out: Path, *args: str) -> tuple[str, dict]:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--base", "HEAD", "--rounds", "1", "--repeats", "1",
                           "--out", str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, json.loads(out.read_text())


def table_rows(stdout: str) -> list[list[str]]:
    """The markdown table's data rows, as cells (the header and its rule left out)."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:] if not line.startswith("|---")]


def check_timings(ms: dict[str, dict[str, list[float]]], rows: list[list[str]]) -> None:
    assert len(rows) == len(ms) > 0
    for by_build in ms.values():
        assert set(by_build) == {"base", "working tree"}
        assert all(len(times) == 1 and times[0] > 0 for times in by_build.values())
    for cells in rows:
        # each row is its case's JSON timings, printed to 2 decimals, and their ratio (computed before rounding:
        # the ratio of two printed values of ~0.6 ms can be 0.02 off it)
        (base,), (tree,) = ms[cells[0]]["base"], ms[cells[0]]["working tree"]
        assert (cells[1], cells[2]) == (f"{base:.2f}", f"{tree:.2f}")
        assert float(cells[3].rstrip("x")) == pytest.approx(base / tree, abs=0.0051)


def test_matmul_builds(tmp_path: Path) -> None:
    stdout, result = run_ab("ab_matmul_builds.py", tmp_path / "ab.json", "--kernel", "w4a8_gemm", "--rows", "1,8")
    rows = table_rows(stdout)
    assert [cells[0] for cells in rows] == ["1", "8"]
    check_timings(result["ms"], rows)
    unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "sgl_lite/runtime/kernels/csrc"], cwd=ROOT).returncode == 0
    if unchanged:  # the same sources built twice: the same bits (the script's check finds no difference)
        assert "outputs differ" not in stdout


def test_attention_builds(tmp_path: Path) -> None:
    stdout, result = run_ab("ab_attention_builds.py", tmp_path / "ab.json")
    check_timings(result["ms"], table_rows(stdout))


def test_extend_builds(tmp_path: Path) -> None:
    stdout, result = run_ab("ab_extend_builds.py", tmp_path / "ab.json", "--layers", "1")
    rows = table_rows(stdout)
    check_timings(result["ms"], rows)
    assert all(float(cells[4]) >= 0 for cells in rows)  # the builds' largest output difference, per case
