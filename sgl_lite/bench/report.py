"""The benchmark's outputs: a markdown table (one row per system), throughput ratios, a per-turn hit
rate table, the JSON report and PNG plots. Input: the `summarize` dicts of sgl_lite.bench.metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

REFERENCE_SYSTEM = "sgl_lite"


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _triple(stats: dict[str, float | None], scale: float = 1.0, fmt: str = ".0f") -> str:
    return "/".join(_num(None if stats[k] is None else stats[k] * scale, fmt) for k in ("p50", "p90", "p99"))


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def markdown_table(summaries: Sequence[dict[str, Any]]) -> str:
    header = ("| system | req/s | in tok/s | out tok/s | TTFT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) "
              "| e2e p50/p90/p99 (s) | hit rate | ideal hit rate | ok/failed |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for s in summaries:
        lines.append(
            f"| {s['system']} | {s['request_throughput']:.2f} | {s['input_throughput']:.0f} | {s['output_throughput']:.1f} "
            f"| {_triple(s['ttft_ms'])} | {_triple(s['itl_ms'], fmt='.1f')} | {_triple(s['e2e_ms'], 1e-3, '.2f')} "
            f"| {_rate(s['cache_hit_rate'])} | {_rate(s['ideal_cache_hit_rate'])} | {s['completed']}/{s['failed']} |")
    notes = ["- ideal hit rate: an infinite cache holding every earlier-sent request's prompt + output "
             "(requests sent together cannot really share: an upper bound)"]
    notes += [f"- {s['system']}: {s['note']}" for s in summaries if s.get("note")]
    notes += [f"- {s['system']}: prompt tokens served per replica: {_shares(s['replica_prompt_tokens'])}"
              for s in summaries if s.get("replica_prompt_tokens")]
    if all("load_avg_1m" in s for s in summaries):
        loads = ", ".join(f"{s['system']} {s['load_avg_1m'][0]:.1f}->{s['load_avg_1m'][1]:.1f}" for s in summaries)
        notes.append(f"- machine load (1-min average, start->end of each run): {loads}")
    notes += [f"- {s['system']} errors: {'; '.join(s['errors'])}" for s in summaries if s.get("errors")]
    return "\n".join([*lines, "", *notes])


def _shares(counts: Sequence[int]) -> str:
    total = sum(counts)
    return " / ".join(f"{c} ({c / total:.0%})" if total else str(c) for c in counts)


def throughput_ratios(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Throughput ratios of systems measured in the same run (same machine: noise mostly cancels).

    With sgl_lite measured: sgl_lite over each other system (the baselines). Without it (say
    router-dp1,router-dp2): every later system over the first one listed."""
    by_name = {s["system"]: s for s in summaries}
    if REFERENCE_SYSTEM in by_name:
        ref = by_name[REFERENCE_SYSTEM]
        pairs = [(ref, s) for s in summaries if s is not ref]
    else:
        pairs = [(s, summaries[0]) for s in summaries[1:]]
    out = []
    for system, baseline in pairs:
        row: dict[str, Any] = {"system": system["system"], "baseline": baseline["system"]}
        for key in ("request_throughput", "output_throughput", "input_throughput"):
            row[key] = system[key] / baseline[key] if baseline[key] else None
        out.append(row)
    return out


def ratio_lines(ratios: Sequence[dict[str, Any]]) -> str:
    return "\n".join(
        f"{r['system']} / {r['baseline']}: req/s x{_num(r['request_throughput'], '.2f')}, "
        f"out tok/s x{_num(r['output_throughput'], '.2f')}, in tok/s x{_num(r['input_throughput'], '.2f')}"
        for r in ratios)


def per_turn_table(summaries: Sequence[dict[str, Any]]) -> str:
    """Hit rate and ideal hit rate of each turn, one column pair per system."""
    turns = sorted({t["turn"] for s in summaries for t in s["per_turn"]})
    header = "| turn | " + " | ".join(f"{s['system']} hit / ideal" for s in summaries) + " |"
    lines = [header, "|---|" + "---|" * len(summaries)]
    for turn in turns:
        cells = []
        for s in summaries:
            row = next((t for t in s["per_turn"] if t["turn"] == turn), None)
            cells.append("n/a" if row is None else f"{_rate(row['hit_rate'])} / {_rate(row['ideal_hit_rate'])}")
        lines.append(f"| {turn} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def write_plots(summaries: Sequence[dict[str, Any]], out_dir: Path, stem: str, per_turn: bool) -> list[Path]:
    """throughput.png and latency.png per system; hit_rate_per_turn.png when `per_turn`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    names = [s["system"] for s in summaries]
    paths = []

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, title in zip(axes, ("request_throughput", "input_throughput", "output_throughput"),
                              ("requests/s", "input tokens/s", "output tokens/s")):
        ax.bar(names, [s[key] for s in summaries], color="C0")
        ax.set_title(title)
    fig.suptitle(f"{stem}: throughput")
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_throughput.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    width = 0.25
    for ax, key, title in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT (ms)", "ITL (ms)", "e2e (ms)")):
        for i, p in enumerate(("p50", "p90", "p99")):
            values = [s[key][p] or 0.0 for s in summaries]
            ax.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=p)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"{stem}: latency")
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_latency.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    if per_turn:
        fig, ax = plt.subplots(figsize=(6, 4))
        ideal_curves: list[list[float]] = []
        for i, s in enumerate(summaries):
            turns = [t["turn"] for t in s["per_turn"]]
            ax.plot(turns, [t["hit_rate"] or 0.0 for t in s["per_turn"]], marker="o", color=f"C{i}", label=s["system"])
            ideal = [t["ideal_hit_rate"] or 0.0 for t in s["per_turn"]]
            # Systems whose outputs agree have the same ideal curve: draw it once.
            if not any(len(c) == len(ideal) and max(abs(a - b) for a, b in zip(c, ideal)) < 1e-3 for c in ideal_curves):
                ideal_curves.append(ideal)
                ax.plot(turns, ideal, linestyle="--", color=f"C{i}", label=f"ideal ({s['system']}'s outputs)")
        ax.set_xticks(sorted({t["turn"] for s in summaries for t in s["per_turn"]}))
        ax.set_xlabel("turn")
        ax.set_ylabel("cache hit rate")
        ax.set_ylim(0, 1)
        ax.legend()
        ax.set_title(f"{stem}: hit rate per turn")
        fig.tight_layout()
        paths.append(out_dir / f"{stem}_hit_rate_per_turn.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
