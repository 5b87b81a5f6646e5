"""`sgl-lite simulate`: replay a workload under each queue policy in virtual time; table, JSON, plot.

    sgl-lite simulate --workload shared-prefix -w gsp_num_groups=16 -s max_running_requests=8 \\
        --request-rate 4 --calibration artifacts/bench_model.json --out artifacts/shared.json
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

import click

from sgl_lite.bench.artifacts import artifact_path, output_file
from sgl_lite.bench.config import BenchConfig, make_workload
from sgl_lite.bench.workloads import WORKLOAD_NAMES
from sgl_lite.runtime.server_args import ServerArgs
from sgl_lite.sim.cost_model import CostModel
from sgl_lite.sim.simulator import POLICIES, policy_args, simulate
from sgl_lite.sim.trace import DEFAULT_VOCAB, from_workload, load_trace

_WORKLOAD_FIELDS = {f.name for f in dataclasses.fields(BenchConfig)
                    if f.name.startswith(("agent_", "gsp_", "random_")) or f.name == "num_prompts"}


def parse_assignments(pairs: tuple[str, ...], cls: type, allowed: set[str], option: str) -> dict[str, Any]:
    """KEY=VALUE strings -> typed values of `cls`'s fields ('none' for None; true/false for flags)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in allowed:
            raise click.BadParameter(f"{pair!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(allowed))}", param_hint=option)
        base = _base_type(hints[name])
        try:
            if text.lower() == "none":
                value = None
            elif base is bool:
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError("expected true or false")
                value = text.lower() in ("true", "1")
            else:
                value = base(text)
        except ValueError as e:
            raise click.BadParameter(f"{pair!r}: {e}", param_hint=option) from None
        out[name] = value
    return out


def _base_type(annotation: Any) -> type:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def print_table(summaries: list[dict[str, Any]]) -> None:
    def fmt(v: Any, scale: float = 1.0, digits: int = 2) -> str:
        return "-" if v is None else f"{v * scale:.{digits}f}"

    classes = sorted({c for s in summaries for c in s["queue_wait_p99_s_by_priority"]}, key=int)
    head = ["policy", "hit rate", "out tok/s", "TTFT p50 s", "TTFT p99 s"] + [f"wait p99 s (prio {c})" for c in classes] + ["preempt", "retract"]
    click.echo("| " + " | ".join(head) + " |")
    click.echo("|" + "---|" * len(head))
    for s in summaries:
        waits = [fmt(s["queue_wait_p99_s_by_priority"].get(c)) for c in classes]
        row = [s["policy"], fmt(s["cache_hit_rate"], 100, 1) + "%", fmt(s["output_tokens_per_s"], 1, 1),
               fmt(s["ttft_p50_s"]), fmt(s["ttft_p99_s"])] + waits + [str(s["preemptions"]), str(s["retractions"])]
        click.echo("| " + " | ".join(row) + " |")


def write_plot(summaries: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [s["policy"] for s in summaries]
    panels = [("cache hit rate", [s["cache_hit_rate"] for s in summaries]),
              ("output tokens/s", [s["output_tokens_per_s"] or 0 for s in summaries]),
              ("TTFT p99 (s)", [s["ttft_p99_s"] or 0 for s in summaries]),
              ("max queue wait (s)", [s["queue_wait_max_s"] or 0 for s in summaries])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (title, values) in zip(axes, panels):
        ax.bar(names, values)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


@click.command("simulate")
@click.option("--workload", type=click.Choice(WORKLOAD_NAMES), default="multiturn-agent", show_default=True,
              help="Bench workload generator (ignored with --trace).")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL trace: arrival, prompt (token ids) or prefix_group/prefix_len/suffix_len, output_len, priority.")
@click.option("-w", "--workload-option", multiple=True, help="KEY=VALUE for the generator (agent_*, gsp_*, random_*, num_prompts).")
@click.option("-s", "--server-arg", multiple=True, help="KEY=VALUE ServerArgs field (e.g. max_running_requests=8).")
@click.option("--policies", default=",".join(POLICIES), show_default=True, help="Comma-separated policies to compare.")
@click.option("--request-rate", type=float, default=math.inf, show_default=True, help="Session arrivals per second (Poisson); inf: all at 0.")
@click.option("--priorities", default="0,10", show_default=True, help="Each generated session draws its priority from these.")
@click.option("--seed", type=int, default=1, show_default=True, help="Seeds the workload, the arrivals and the random policy.")
@click.option("--think-time", type=float, default=0.0, show_default=True, help="Virtual seconds between a turn's finish and the next turn.")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), default=None,
              help="scripts/bench_model.py JSON to calibrate the step cost (default: built-in numbers for a 2-core CPU).")
@click.option("--out", type=click.Path(dir_okay=False), default=artifact_path("simulate.json"), show_default=True)
@click.option("--plot/--no-plot", default=True, show_default=True)
def simulate_command(workload: str, trace: str | None, workload_option: tuple[str, ...], server_arg: tuple[str, ...],
                     policies: str, request_rate: float, priorities: str, seed: int, think_time: float,
                     calibration: str | None, out: str, plot: bool) -> None:
    """Replay a workload through the real scheduler with a cost-model runner, once per policy."""
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in chosen if p not in POLICIES]
    if bad or not chosen:
        raise click.BadParameter(f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(POLICIES)}", param_hint="--policies")
    try:
        classes = tuple(int(p) for p in priorities.split(","))
    except ValueError:
        raise click.BadParameter(f"{priorities!r}: expected comma-separated integers", param_hint="--priorities") from None
    if request_rate <= 0:
        raise click.BadParameter(f"must be positive (inf: all at once); got {request_rate}", param_hint="--request-rate")
    server_values = parse_assignments(server_arg, ServerArgs, {f.name for f in dataclasses.fields(ServerArgs)}, "--server-arg")
    try:
        # --seed also seeds the random policy's shuffle (unless -s random_seed=... says otherwise): same flags, same table.
        base = ServerArgs(**{"random_seed": seed, **server_values})
        cost = CostModel.from_bench_model_json(calibration) if calibration else CostModel.default()
        if trace:
            sessions = load_trace(trace, DEFAULT_VOCAB, seed)
        else:
            config = BenchConfig(workload=workload, seed=seed,
                                 **parse_assignments(workload_option, BenchConfig, _WORKLOAD_FIELDS, "--workload-option"))
            sessions = from_workload(make_workload(config, DEFAULT_VOCAB), request_rate, seed, classes)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    summaries = []
    for policy in chosen:
        result = simulate(sessions, policy_args(base, policy), cost, policy=policy, think_time_s=think_time)
        summaries.append(result.summary)
    print_table(summaries)
    out_path = output_file(out)
    report = {"workload": trace or workload, "workload_options": list(workload_option), "server_args": server_values,
              "request_rate": request_rate, "seed": seed, "cost_model": cost.to_json(), "results": summaries}
    out_path.write_text(json.dumps(report, indent=2))
    click.echo(f"wrote {out_path}")
    if plot and write_plot(summaries, out_path.with_suffix(".png")):
        click.echo(f"wrote {out_path.with_suffix('.png')}")


if __name__ == "__main__":
    simulate_command()
