#!/usr/bin/env bash
# Creates .venv (if missing) and installs paratrain into it, editable, with EXTRAS
# (default: report,tensorboard — the run records; scripts/test.sh asks for test).
# torch is pinned through constraints.txt: an unpinned torch pulls GBs of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-report,tensorboard}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints.txt -e ".[$EXTRAS]"
