"""DDP and FSDP2 over nccl with one rank, next to no wrapper at all: paratrain resolves any
strategy to `single` for one process, so this drives the parallelism objects themselves (the
ones the loop uses: wrap, autocast, grad scaler, the optimizer on offloaded shards) over a real
nccl process group of one rank on GPU 0. Prints one JSON line: each variant's 10 losses.

Run as `python -m tests.gpu._world_one` from the repository root."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.config import OptimConfig
from paratrain.dist import DistEnv
from paratrain.launch.environment import free_port
from paratrain.models import build_model
from paratrain.config.presets import ModelArgs
from paratrain.parallel.precision import prepare_model
from paratrain.parallel.parallelize import parallelize
from paratrain.parallel.strategies import DDP, FSDP, Parallelism
from paratrain.runtime.optim import build_optimizer

ARGS = ModelArgs(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=192, vocab_size=384, max_seq_length=64, tie_embeddings=False)
VARIANTS = {  # name: (parallelism, precision)
    "single": (Parallelism(), "fp32"), "ddp": (DDP(), "fp32"), "fsdp": (FSDP(), "fp32"),
    "fsdp-offload": (FSDP(cpu_offload=True), "fp32"),
    "single-bf16": (Parallelism(), "bf16-mixed"), "ddp-bf16": (DDP(), "bf16-mixed"),
    "fsdp-bf16": (FSDP(), "bf16-mixed"), "fsdp-fp16": (FSDP(), "fp16-mixed"),
}


def train(parallelism: Parallelism, precision: str, env: DistEnv, steps: int = 10) -> list[float]:
    torch.manual_seed(0)
    model = parallelize(prepare_model(build_model(ARGS), precision), parallelism, env,
                        precision=precision)
    optimizer = build_optimizer(model, OptimConfig(lr=3e-3), env.device)
    scaler = parallelism.grad_scaler(precision, env.device)
    # one batch, every step: the model memorises it, so the loss falls fast
    tokens = torch.randint(0, ARGS.vocab_size, (8, 65),  # (B, T + 1)
                           generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1].to(env.device), tokens[:, 1:].to(env.device)  # (B, T) each
    losses = []
    for _ in range(steps):
        with parallelism.autocast(precision, env.device):
            logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    env = DistEnv(device=device, backend="nccl")
    out = {name: train(p, precision, env) for name, (p, precision) in VARIANTS.items()}
    out["backend"] = dist.get_backend()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
