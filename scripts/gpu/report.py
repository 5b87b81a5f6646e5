"""The device check's report: its environment, the CUDA tests' outcome, the decode table and the agent
workload against transformers, as markdown.

    python scripts/gpu/report.py OUT_DIR > OUT_DIR/report.md     (scripts/gpu/device_check.sh runs it)
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from datetime import datetime, timezone
from pathlib import Path


def tests_section(out: Path, name: str) -> list[str]:
    junit = out / f"{name}.xml"
    if not junit.exists():
        return [f"CUDA tests ({name}): no result (see work/{name}.log in logs.tgz)."]
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    lines = [f"CUDA tests ({name}, tests/test_cuda.py): {counts['tests']} run, {counts['failures']} failed, {counts['errors']} errors, "
             f"{counts['skipped']} skipped", ""]
    for case in suite.iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        lines.append(f"- {'FAIL' if failed else 'skip' if skipped else 'pass'} {case.get('name')}")
    return lines


def bench_section(out: Path) -> list[str]:
    path = out / "bench_gpu.json"
    if not path.exists():
        return ["Decode benchmark: no result (see work/bench_gpu.log in logs.tgz)."]
    data = json.loads(path.read_text())
    lines = [f"Decode on {data['device']}, random weights, {data['context']}-token contexts, {data['steps']} steps a window; "
             f"copy bandwidth {data['bandwidth_bytes_s'] / 1e9:.0f} GB/s (read + write); of roofline and ratio from the faster of eager "
             "and CUDA graphs:", "",
             "| shape | batch | eager tok/s | CUDA graphs tok/s | roofline tok/s | of roofline | transformers tok/s | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        hf, graphs = r.get("transformers_tok_s"), r.get("graphs_tok_s")
        best = max(r["eager_tok_s"], graphs or 0.0)
        ratio = f"{best / hf:.1f}x" if hf else ""
        lines.append(f"| {r['shape']} | {r['batch']} | {r['eager_tok_s']:.0f} | {f'{graphs:.0f}' if graphs else '-'} | {r['roofline_tok_s']:.0f} | "
                     f"{r['of_roofline']:.0%} | {f'{hf:.0f}' if hf else ''} | {ratio} |")
    return lines


def step_section(out: Path) -> list[str]:
    log = out / "work" / "bench_step.log"
    text = log.read_text() if log.exists() else ""
    start = text.find("| batch |")
    if start < 0:
        return ["Decode step split: no result (see work/bench_step.log in logs.tgz)."]
    table = text[start:].split("\n\n")[0].strip()
    return ["A served decode step split into the host's gap (scheduler, runner prep) and the device's work, ms "
            "(scripts/bench_step.py --device cuda; its profile of batch 1 is in logs.tgz):", "", table]


def serving_section(out: Path) -> list[str]:
    path = out / "serving.json"
    if not path.exists():
        return ["Agent workload: no result (see work/serving.log in logs.tgz)."]
    from sgl_lite.bench.driver import format_report

    return ["Agent workload (scripts/bench_serving.py), both systems on the GPU:", "", format_report(json.loads(path.read_text()))]


def main() -> None:
    out = Path(sys.argv[1])
    env = (out / "env.txt").read_text() if (out / "env.txt").exists() else "(no env.txt)"
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print("\n".join([f"# GPU device check, {when}", "", "```", env.strip(), "```", "", *tests_section(out, "kernel_tests"), "",
                      *tests_section(out, "engine_tests"), "", *bench_section(out), "",
                      *step_section(out), "", *serving_section(out), ""]))


if __name__ == "__main__":
    main()
