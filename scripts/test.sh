#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m pytest -q "$@"
