"""Where the tools write what they produce: one git-ignored folder, `artifacts/`, by default.

Benchmarks (scripts/bench_*.py, sgl_lite.bench), the simulator, the protocol fuzzer and the soak test
all default their JSON reports and PNG plots to a path under ARTIFACTS_DIR, so that a run never
leaves files in the working directory or the repository.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARTIFACTS_DIR = "artifacts"


def artifact_path(name: str) -> str:
    """The default output path of a report named `name` (e.g. "bench_step.json")."""
    return f"{ARTIFACTS_DIR}/{name}"


def output_file(path: str | Path) -> Path:
    """`path` with its folder created: call before writing a report there."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files, no display), or None, said once, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot")
        return None
    return plt


def save_png(fig: Any, report: str | Path) -> Path:
    """Lay out a matplotlib figure and save it beside a JSON report (same name, .png); returns the path."""
    path = Path(report).with_suffix(".png")
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")
    return path
