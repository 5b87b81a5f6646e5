"""Serving benchmark: throughput, TTFT / ITL / e2e percentiles and prefix-cache hit rate (with the
ideal hit rate of the workload) for sgl_lite, the same runtime with --disable-radix-cache, and a
naive transformers server, on one reproducible workload.

    python scripts/bench_serving.py --workload multiturn-agent --agent-num-sessions 8 --agent-num-turns 4
    python scripts/bench_serving.py --workload shared-prefix --gsp-num-groups 8 --gsp-prompts-per-group 8
    python scripts/bench_serving.py --workload random --num-prompts 32 --request-rate 2 --max-concurrency 8
    python scripts/bench_serving.py --address http://127.0.0.1:30000 --systems sgl_lite   # over ZeroMQ
    python scripts/bench_serving.py --url http://127.0.0.1:30000 --systems sgl_lite      # HTTP server or router
    python scripts/bench_serving.py --systems router-dp1,router-dp2   # N replicas behind sglang-router

Any runtime flag (--max-total-tokens, --schedule-policy, --dtype, ...) is passed to the runtimes it
starts (every replica of a router-dpN system too). Writes a JSON report and PNG plots to
--output-dir (default artifacts/bench/).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_lite.bench.driver import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
