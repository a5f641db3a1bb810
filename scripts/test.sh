#!/usr/bin/env bash
# Installs paratrain into .venv and runs the whole test suite (unit, distributed, end-to-end,
# the docs' blocks and `mkdocs build --strict`), its files spread over one pytest-xdist worker per
# core (at most 4), a file's tests together (they share its module fixtures); the session's inputs
# and cached runs are built once for all (tests/_shared.py).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test,docs bash scripts/install.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile "$@"
