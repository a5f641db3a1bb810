"""The reference for `paratrain bench`: a hand-written PyTorch DDP loop, no framework.

This is the script a user would write without paratrain (the DataParallel seed's shape):
DistributedSampler, a DDP wrap, AdamW, gradient clipping, a for loop. It reads a paratrain
config only to train the *same* model on the *same* tokens with the same per-device batch, so
that any difference in speed is the cost (or gain) of paratrain's loop and wrappers.

    torchrun --standalone --nproc_per_node=2 -m paratrain.tools.plain_ddp [CONFIG.yaml] [key=value ...] \
        --out plain.json

Every step is timed end to end (step end to step end, data loading included), the same way
paratrain's loop times its steps; rank 0 writes the times and each rank's peak memory to --out.

`--nproc N` (what `paratrain bench` uses) starts the N workers with the engine behind torchrun,
`elastic_launch`, from Python, exactly as paratrain starts its own. The torchrun command line
would put every worker in a session of its own, and with Linux's scheduler autogroups
(/proc/sys/kernel/sched_autogroup_enabled) each session gets its own CPU share: on a machine
shared with other jobs that alone made torchrun's workers up to 1.6x faster than the same loop
started in one session, which is a comparison of launch layouts, not of training loops.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ..config.tree import TrainConfig
from ..data import build_dataset, collate, prepare_data
from ..models import build_model, resolve_model_config


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    ap.add_argument("--out", required=True, help="where rank 0 writes the timings (JSON)")
    ap.add_argument("--nproc", type=int, default=0,
                    help="start this many workers here (elastic_launch) instead of via torchrun")
    ns = ap.parse_args(argv)
    if ns.nproc > 1 and "RANK" not in os.environ:
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        from ..launch.environment import free_port
        from . import plain_ddp
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ns.nproc,
                              rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                              rdzv_configs={"rank": 0}, run_id="plain", monitor_interval=0.1,
                              start_method="spawn")
        elastic_launch(config, plain_ddp.main)(ns.args + ["--out", ns.out])
        return
    path = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    cfg = TrainConfig.from_yaml(path, [a for a in ns.args if "=" in a])
    tr = cfg.trainer

    # -- who am I (torchrun sets these; one process without it) --
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available() and str(tr.devices).lower() not in ("cpu",) \
            and not str(tr.devices).lower().startswith("cpu:"):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # the same thread share paratrain gives each rank: compare loops, not thread counts
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    # -- the same data and model as paratrain's run --
    prepared = prepare_data(cfg.corpus_data, cfg.cache_dir)  # already cached by `paratrain bench`
    train_ds = build_dataset(prepared, "train", cfg.data, packed=cfg.task_spec.packed)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True,
                                 seed=tr.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=tr.batch_size, sampler=sampler, drop_last=True,
                        collate_fn=collate, num_workers=cfg.data.num_workers,
                        pin_memory=device.type == "cuda")
    accum = (tr.global_batch_size // (tr.batch_size * world)) if tr.global_batch_size else 1
    args = resolve_model_config(cfg.model, vocab_size=cfg.model.vocab_size or
                                prepared.vocab_size, seq_length=cfg.data.seq_length)
    torch.manual_seed(tr.seed)
    model = build_model(args).to(device)
    if tr.compile:  # as paratrain's trainer.compile does: each block on its own
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    if world > 1:
        # RoPE tables are the only buffers and never change: no need to broadcast them each step
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                    broadcast_buffers=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay,
                                  fused=True if device.type == "cuda" else None)
    use_bf16 = tr.precision == "bf16-mixed"

    # -- the loop --
    step_times, epoch, step = [], 0, 0
    batches = iter(loader)
    t_last, c_last = time.perf_counter(), time.process_time()
    cpu_times = []
    while step < tr.max_steps:
        for i in range(accum):
            try:
                batch = next(batches)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                batches = iter(loader)
                batch = next(batches)
            x = batch["input_ids"].to(device, non_blocking=True)
            y = batch["targets"].to(device, non_blocking=True)
            mask = batch.get("attention_mask")
            mask = mask.to(device, non_blocking=True) if mask is not None else None
            last = i == accum - 1
            with model.no_sync() if world > 1 and not last else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                    logits = model(x, attention_mask=mask)  # (B, T, V)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(),
                                       ignore_index=-100) / accum
                loss.backward()
        if cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        step_times.append(now - t_last)
        cpu_times.append(time.process_time() - c_last)
        t_last, c_last = now, time.process_time()

    # -- report --
    mem = [{"rank": rank, "device": str(device), "peak_bytes": peak_bytes(device)}]
    if world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mem[0])
        mem = everyone
    if rank == 0:
        out = {"step_times_s": step_times, "step_cpu_s": cpu_times, "memory": mem, "world_size": world,
               "final_loss": loss.item() * accum, "global_batch_size":
               tr.batch_size * world * accum, "seq_length": cfg.data.seq_length}
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=2)
    if world > 1:  # a DDP module still alive at destroy_process_group can abort the process
        del model, optimizer, loss, logits
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
