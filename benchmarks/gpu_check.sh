#!/usr/bin/env bash
# benchmarks/gpu_check.sh OUTDIR: everything this project measures on a GPU, in one command that
# finishes within 8 minutes on a machine with one NVIDIA GPU, PyTorch installed and no network.
#
#   1. installs paratrain (pip --no-deps, built from this checkout) and the few packages the
#      machine lacks, from the wheels in .whl/ only (--no-index), into a venv that sees the
#      machine's own packages (--system-site-packages): the installed torch is used, never
#      replaced (checked: its version before and after must agree);
#   2. runs the GPU tier (tests/gpu, marker gpu) with JUnit XML;
#   3. runs the throughput bench (benchmarks/gpu_throughput.py: Llama large and 1b, eager and
#      compiled, against a plain PyTorch loop).
# Without a GPU it says so and exits 0 (nothing to check).
#
# OUTDIR gets at most 8 files, no subfolders: summary.txt, env.txt, install.log, gpu-tier.xml,
# gpu-tier.log, gpu_throughput.json, gpu_throughput.log. The runs' own files go to $TMPDIR.
#
# .whl/ (git-ignored) is filled on a machine with a package index, for the GPU machines' python
# 3.12 (torch 2.11.0+cu130, transformers, peft, tokenizers, safetensors, tensorboard, pytest
# already there; omegaconf and its antlr runtime not; setuptools>=77 builds paratrain):
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --no-deps -d .whl omegaconf==2.3.0 PyYAML pytest-timeout 'setuptools>=77'
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # sdist only: a pure-python wheel
set -uo pipefail

OUT=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}  # 8 minutes, less the slack for writing the summary
TIER_MAX_S=260                        # the tier's share; the bench gets what is left

say() { echo "gpu_check: $*" | tee -a "$OUT/summary.txt"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
: > "$OUT/summary.txt"

# ---- a GPU? ----------------------------------------------------------------------------------
if ! command -v "$PY" >/dev/null; then
  say "no GPU found: there is no $PY here (set PYTHON=...); nothing to check"
  exit 0
fi
found=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
if [ -z "$found" ]; then
  say "no GPU found: $PY has no PyTorch; nothing to check"
  exit 0
fi
if [ "$found" = 0 ]; then
  say "no GPU found (torch.cuda.is_available() is False for $PY); nothing to check"
  exit 0
fi
{
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda); [print(f"cuda:{i}", torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]'
  nvidia-smi 2>&1 | head -20
} > "$OUT/env.txt" 2>&1
say "$found GPU(s): $(sed -n 3p "$OUT/env.txt"); $(sed -n 2p "$OUT/env.txt")"

# ---- install: a venv over the machine's packages, wheels from .whl/ only ---------------------
VENV=${TMPDIR:-/tmp}/paratrain-gpu-check-venv
TORCH_BEFORE=$("$PY" -c 'import torch; print(torch.__version__)')
install() {
  rm -rf "$VENV"
  # --without-pip: the machine's own pip (a system site package) installs into the venv
  "$PY" -m venv --system-site-packages --without-pip "$VENV" || return 1
  local vpy="$VENV/bin/python" pip=(-m pip install --no-index --find-links .whl --no-deps)
  # what the machine lacks (already-installed ones are left as they are), then paratrain
  "$vpy" "${pip[@]}" omegaconf antlr4-python3-runtime PyYAML pytest-timeout || return 1
  "$vpy" "${pip[@]}" . || return 1  # build isolation: setuptools from .whl/
  "$vpy" -c 'import paratrain, omegaconf' && "$VENV/bin/paratrain" --help >/dev/null
}
export VENV PY
timeout 150 bash -c "$(declare -f install); install" > "$OUT/install.log" 2>&1
rc=$?
VPY=$VENV/bin/python
TORCH_AFTER=$("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
if [ $rc -ne 0 ] || [ "$TORCH_AFTER" != "$TORCH_BEFORE" ]; then
  say "install FAILED (exit $rc; torch $TORCH_BEFORE before, '${TORCH_AFTER}' after): see install.log"
  exit 1
fi
say "installed paratrain into $VENV (torch $TORCH_AFTER untouched) in $(( $(date +%s) - START )) s"

# ---- the GPU tier ----------------------------------------------------------------------------
t=$(( $(left) < TIER_MAX_S ? $(left) : TIER_MAX_S ))
t0=$(date +%s)
[ "$t" -gt 30 ] || t=30  # (timeout 0 would mean no limit at all)
timeout -k 10 "$t" "$VPY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider -rs \
  --junitxml="$OUT/gpu-tier.xml" > "$OUT/gpu-tier.log" 2>&1
tier=$?
say "GPU tier: exit $tier in $(( $(date +%s) - t0 )) s (limit $t s): $(tail -1 "$OUT/gpu-tier.log")"

# ---- the throughput bench --------------------------------------------------------------------
t=$(left)
t0=$(date +%s)
if [ "$t" -gt 30 ]; then
  timeout -k 10 "$t" "$VPY" benchmarks/gpu_throughput.py --out "$OUT" \
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
