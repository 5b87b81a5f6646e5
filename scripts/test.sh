#!/usr/bin/env bash
# Install (idempotent), lint, and run the tests. Extra arguments go to pytest.
#   bash scripts/test.sh           the whole suite, what CI runs (the 25 slowest tests listed at the end)
#   bash scripts/test.sh --fast    unit, kernel and in-process tests only: no test that starts a process or a
#                                  server, loads the default model, soaks, or compiles C++ (tests/tiers.py)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m ruff check --quiet .
selection=(--durations=25)
args=()
for arg in "$@"; do
    if [[ "$arg" == "--fast" ]]; then
        selection=(-m "not server and not default_model and not soak and not kernel_build" --durations=10)
    else
        args+=("$arg")
    fi
done
python -m pytest -q "${selection[@]}" "${args[@]+"${args[@]}"}"
