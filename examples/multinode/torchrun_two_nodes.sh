#!/usr/bin/env bash
# Two nodes with torchrun: run this script on each node with its NODE_RANK (0 on the master).
#   node 0 (10.0.0.1):  NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./torchrun_two_nodes.sh cfg.yaml
#   node 1:             NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./torchrun_two_nodes.sh cfg.yaml
# paratrain reads RANK/LOCAL_RANK/WORLD_SIZE from torchrun and launches nothing itself; only
# global rank 0 (on node 0) writes the run dir. Without torchrun, the same job is:
#   paratrain train cfg.yaml distributed.nnodes=2 distributed.node_rank=$NODE_RANK \
#       distributed.master_addr=$MASTER_ADDR distributed.master_port=$MASTER_PORT
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK (0 on the master node)}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-2}
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
CONFIG=${1:-}
shift || true
# Uncomment when hosts have several interfaces and gloo/NCCL pick the wrong one:
# export GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0
torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$GPUS" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
    -m paratrain train ${CONFIG:+"$CONFIG"} distributed.timeout_s=600 "$@"
