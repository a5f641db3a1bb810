#!/usr/bin/env bash
# Creates .venv (if missing) and installs paratrain into it with its test extras.
# torch is pinned through constraints.txt: an unpinned torch pulls GBs of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
