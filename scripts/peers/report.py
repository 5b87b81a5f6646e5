"""scripts/bench_peers.py's report of one run: a markdown table and a bar plot of every system's results.

A result is one system's dict: `system` (its name), `label` (its row's label) and `runs`, a list of runs per
measurement kind ("8" sessions, "1" session, "8_neighbour": 8 sessions beside a busy neighbour), each run
with its `output_tok_s` and `server_cpu_ms_per_token`. A module, not a command.
"""

from __future__ import annotations

from pathlib import Path

KINDS = ("8", "1", "8_neighbour")


def best(result: dict, kind: str) -> float | None:
    """The system's highest output tok/s over its runs of this kind (None: no such run)."""
    values = [r["output_tok_s"] for r in result["runs"][kind]]
    return max(values) if values else None


def _short(name: str) -> str:
    return "vLLM" if name == "vllm" else name


def table(results: list[dict], baseline: str, busy: str) -> list[str]:
    """The markdown table's lines: per system its best (and, with more than one, every) run of each kind,
    its 8- and 1-session figures as ratios of `baseline`'s in this run ("-" when that system has none),
    and the least server CPU time per output token of its 8- and 1-session runs."""
    base = next((r for r in results if r["system"] == baseline), None)
    lines = [f"| server | 8 sessions | 1 session | 8 sessions, {busy} | 8 sessions vs {_short(baseline)} "
             f"| 1 session vs {_short(baseline)} | server CPU ms per output token, 8 / 1 sessions |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        cells = []
        for kind in KINDS:
            top = best(r, kind)
            runs = ", ".join(f"{x['output_tok_s']:.1f}" for x in r["runs"][kind])
            cells.append("-" if top is None else f"{top:.1f}" + (f" ({runs})" if len(r["runs"][kind]) > 1 else ""))
        for kind in ("8", "1"):
            top, base_top = best(r, kind), base and best(base, kind)
            cells.append(f"{top / base_top:.2f}x" if top is not None and base_top else "-")
        cpu = [min((x["server_cpu_ms_per_token"] for x in r["runs"][k]), default=None) for k in ("8", "1")]
        cells.append(" / ".join("-" if c is None else f"{c:.1f}" for c in cpu))
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return lines


def plot(results: list[dict], busy: str, out: Path) -> None:
    """Bars of every system's best output tok/s per kind, as a PNG beside `out` (nothing without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from sgl_lite.bench.artifacts import save_png

    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = ["8 sessions", "1 session", f"8 sessions, {busy}"]
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        ax.bar([k + i * width for k in range(len(KINDS))], [best(r, kind) or 0 for kind in KINDS], width, label=r["label"])
    ax.set_xticks([k + width * (len(results) - 1) / 2 for k in range(len(KINDS))], labels)
    ax.set_ylabel("output tok/s")
    ax.legend(fontsize=7)
    save_png(fig, out)
