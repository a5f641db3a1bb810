#!/usr/bin/env bash
# Installs paratrain into .venv and runs the whole test suite (unit, distributed, end-to-end,
# the docs' blocks and `mkdocs build --strict`).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test,docs bash scripts/install.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest "$@"
