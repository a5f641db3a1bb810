#!/usr/bin/env bash
# Slurm: 2 nodes x 4 GPUs, one task per GPU. `sbatch sbatch_two_nodes.sh cfg.yaml`
# srun starts the 8 tasks; each reads its rank from SLURM_PROCID / SLURM_LOCALID /
# SLURM_NTASKS and finds rank 0 at the first host of SLURM_NODELIST (port derived from the job
# id, or MASTER_PORT if exported). No torchrun, no extra flags.
#SBATCH --job-name=paratrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=USR1@90
#SBATCH --requeue
# 90 s before the time limit Slurm sends SIGUSR1: every rank finishes its step, a snapshot is
# committed, rank 0 runs `scontrol requeue $SLURM_JOB_ID` (distributed.requeue=true) and the
# job exits 138; when it starts again, the same command resumes from that snapshot.
set -euo pipefail
CONFIG=${1:-configs/llama-small.yaml}
# Each task uses GPU SLURM_LOCALID of its node, so every task must see all of its node's GPUs
# (no per-task CUDA_VISIBLE_DEVICES binding; add --gpu-bind=none if your site binds by default).
# The token cache lives on a shared filesystem: built once, reused by every node.
export PARATRAIN_CACHE=${PARATRAIN_CACHE:-$HOME/.cache/paratrain}
srun paratrain train "$CONFIG" trainer.devices=cuda data.cache_dir="$PARATRAIN_CACHE" \
    distributed.timeout_s=600 checkpoint.every_steps=500 distributed.requeue=true
