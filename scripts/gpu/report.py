"""The device check's report: its environment, the CUDA tests' outcome and the decode table, as markdown.

    python scripts/gpu/report.py OUT_DIR > OUT_DIR/report.md     (scripts/gpu/device_check.sh runs it)
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from datetime import datetime, timezone
from pathlib import Path


def tests_section(out: Path) -> list[str]:
    junit = out / "cuda_tests.xml"
    if not junit.exists():
        return ["CUDA tests: no result (see cuda_tests.log)."]
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    lines = [f"CUDA tests (tests/test_cuda.py): {counts['tests']} run, {counts['failures']} failed, {counts['errors']} errors, "
             f"{counts['skipped']} skipped", ""]
    for case in suite.iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        lines.append(f"- {'FAIL' if failed else 'skip' if skipped else 'pass'} {case.get('name')}")
    return lines


def bench_section(out: Path) -> list[str]:
    path = out / "bench_gpu.json"
    if not path.exists():
        return ["Decode benchmark: no result (see bench_gpu.log)."]
    data = json.loads(path.read_text())
    lines = [f"Decode on {data['device']}, random weights, {data['context']}-token contexts, {data['steps']} steps a window; "
             f"copy bandwidth {data['bandwidth_bytes_s'] / 1e9:.0f} GB/s (read + write); no CUDA graphs:", "",
             "| shape | batch | sgl_lite tok/s | roofline tok/s | of roofline | transformers tok/s | ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        hf = r.get("transformers_tok_s")
        ratio = f"{r['sgl_lite_tok_s'] / hf:.1f}x" if hf else ""
        lines.append(f"| {r['shape']} | {r['batch']} | {r['sgl_lite_tok_s']:.0f} | {r['roofline_tok_s']:.0f} | {r['of_roofline']:.0%} | "
                     f"{f'{hf:.0f}' if hf else ''} | {ratio} |")
    return lines


def main() -> None:
    out = Path(sys.argv[1])
    env = (out / "env.txt").read_text() if (out / "env.txt").exists() else "(no env.txt)"
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print("\n".join([f"# GPU device check, {when}", "", "```", env.strip(), "```", "", *tests_section(out), "", *bench_section(out), ""]))


if __name__ == "__main__":
    main()
