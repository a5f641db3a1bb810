#!/usr/bin/env bash
# benchmarks/gpu_check.sh OUTDIR: everything this project measures on a GPU, in one command that
# finishes within 6 minutes on a machine with one NVIDIA GPU, PyTorch installed and no network
# (a session is lent 15 minutes of device time, starts included: room for the check and a rerun).
#
#   1. installs paratrain (pip --no-deps, built from this checkout) and the few packages the
#      machine lacks, from the wheels in .whl/ only (--no-index), into a folder put first on
#      PYTHONPATH (pip --target): the machine's torch is used, never replaced (checked: its
#      version before and after must agree);
#   2. runs the GPU tier (tests/gpu, marker gpu) with JUnit XML, on 4 pytest-xdist workers
#      sharing the GPU when xdist is there (one after another the tier took ~520 s on an H100);
#   3. runs the throughput bench alone (benchmarks/gpu_throughput.py: Llama large and 1b,
#      compiled, against a plain PyTorch loop; GPU_CHECK_MODES=eager,compiled adds the eager
#      rows, ~110 s more).
# Without a GPU it says so and exits 0 (nothing to check).
#
# OUTDIR gets at most 8 files, no subfolders: summary.txt, env.txt, install.log, gpu-tier.xml,
# gpu-tier.log, gpu_throughput.json, gpu_throughput.log. The runs' own files go to $TMPDIR.
#
# .whl/ (git-ignored) is filled on a machine with a package index, for the GPU machines' python
# 3.12 (torch 2.11.0+cu130, transformers, peft, tokenizers, safetensors, tensorboard, pytest
# already there; omegaconf not: 2.4 carries its own antlr parser; setuptools>=77 builds
# paratrain in pip's isolated build):
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --no-deps -d .whl omegaconf==2.4.0 PyYAML pytest-timeout 'setuptools>=77'
# The device tool carries .whl/ with the checkout when asked (carry: [".whl"]).
set -uo pipefail

OUT=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR [--install-only]}
MODE=${2:-}  # --install-only: the install step alone, GPU or not (its rehearsal)
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-360}  # 6 minutes: the install, the tier, the bench
TIER_MAX_S=150  # the tier's session limit: a test in flight then finishes (the longest ~45 s)
MODES=${GPU_CHECK_MODES:-compiled}

say() { echo "gpu_check: $*" | tee -a "$OUT/summary.txt"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
: > "$OUT/summary.txt"

# ---- a GPU? ----------------------------------------------------------------------------------
if ! command -v "$PY" >/dev/null; then
  say "no GPU found: there is no $PY here (set PYTHON=...); nothing to check"
  exit 0
fi
found=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' \
  2>/dev/null)
if [ -z "$found" ]; then
  say "no GPU found: $PY has no PyTorch; nothing to check"
  exit 0
fi
if [ "$found" = 0 ] && [ "$MODE" != --install-only ]; then
  say "no GPU found (torch.cuda.is_available() is False for $PY); nothing to check"
  exit 0
fi
{
  "$PY" -c '
import sys, torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}", torch.cuda.get_device_name(i))'
  if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1 | head -20; fi
} > "$OUT/env.txt" 2>&1
say "$found GPU(s) ($(sed -n 3p "$OUT/env.txt")); $(sed -n 2p "$OUT/env.txt")"

# ---- install: a private folder on PYTHONPATH, wheels from .whl/ only -------------------------
# pip --target works whatever python3 is (system, venv, conda; no ensurepip needed) and leaves
# the machine's packages alone: only what is missing goes there, and never torch
SITE=${TMPDIR:-/tmp}/paratrain-gpu-check-site
TORCH_BEFORE=$("$PY" -c 'import torch; print(torch.__version__)')
install() {
  rm -rf "$SITE"
  local pip=(-m pip install --no-index --find-links .whl --no-deps --target "$SITE")
  local missing=() pair
  for pair in omegaconf:omegaconf yaml:PyYAML pytest_timeout:pytest-timeout; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
  done
  echo "missing here, installed from .whl/: ${missing[*]:-nothing}"
  if [ ${#missing[@]} -gt 0 ]; then "$PY" "${pip[@]}" "${missing[@]}" || return 1; fi
  "$PY" "${pip[@]}" . || return 1  # built in pip's isolated build: setuptools from .whl/
  PYTHONPATH="$SITE" "$PY" -c 'import paratrain, omegaconf; print("paratrain", paratrain.__file__)' \
    && PYTHONPATH="$SITE" "$SITE/bin/paratrain" --help >/dev/null && echo "paratrain --help: ok"
}
export SITE PY
timeout 150 bash -c "$(declare -f install); install" > "$OUT/install.log" 2>&1
rc=$?
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
TORCH_AFTER=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
if [ $rc -ne 0 ] || [ "$TORCH_AFTER" != "$TORCH_BEFORE" ]; then
  say "install FAILED (exit $rc; torch $TORCH_BEFORE before, '${TORCH_AFTER}' after): see install.log"
  exit 1
fi
say "installed paratrain into $SITE (torch $TORCH_AFTER untouched) in $(( $(date +%s) - START )) s"
if [ "$MODE" = --install-only ]; then exit 0; fi

# ---- the GPU tier ----------------------------------------------------------------------------
t=$(( $(left) < TIER_MAX_S ? $(left) : TIER_MAX_S ))
t0=$(date +%s)
[ "$t" -gt 30 ] || t=30  # (timeout 0 would mean no limit at all)
# pytest-timeout's session limit stops each worker after the test it is in, in time to write
# the JUnit XML; `timeout` is the backstop
workers=()
if "$PY" -c 'import xdist' 2>/dev/null; then workers=(-n 4 --dist loadfile); fi
timeout -k 10 $((t + 60)) "$PY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider -rs \
  "${workers[@]}" --session-timeout="$t" --junitxml="$OUT/gpu-tier.xml" \
  > "$OUT/gpu-tier.log" 2>&1
tier=$?
say "GPU tier: exit $tier in $(( $(date +%s) - t0 )) s (limit $t s): $(tail -1 "$OUT/gpu-tier.log")"

# ---- the throughput bench --------------------------------------------------------------------
t=$(left)
t0=$(date +%s)
if [ "$t" -gt 30 ]; then
  timeout -k 10 "$t" "$PY" benchmarks/gpu_throughput.py --out "$OUT" --modes "$MODES" \
    > "$OUT/gpu_throughput.log" 2>&1
  bench=$?
  say "throughput bench: exit $bench in $(( $(date +%s) - t0 )) s (limit $t s)"
  grep -E '^(preset|large|1b|targets)' "$OUT/gpu_throughput.log" | tee -a "$OUT/summary.txt"
else
  bench=124
  say "throughput bench: not run, only $t s of the budget left"
fi

say "done in $(( $(date +%s) - START )) s"
[ $tier -eq 0 ] && [ $bench -eq 0 ]
