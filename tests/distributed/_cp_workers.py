"""Worker function for the context-parallel gradient test (torch.multiprocessing.spawn pickles it
by module name): one micro-batch's loss and gradients, each rank computing its chunks."""

from __future__ import annotations

import os

import torch


def tiny_model(arch: str, seq: int) -> torch.nn.Module:
    from paratrain.config import ModelConfig
    from paratrain.config.presets import resolve_model_config
    from paratrain.models import build_model
    torch.manual_seed(0)
    return build_model(resolve_model_config(ModelConfig(preset="tiny", arch=arch),
                                            vocab_size=97, seq_length=seq))


def batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, seq) token ids and their next-token targets, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 97, (2, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                   tokens: int) -> tuple[torch.Tensor, dict]:
    """These tokens' share of the mean loss over all `tokens` of the batch, and its grads."""
    logits = model(ids)  # (B, T_local, V)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             reduction="sum") / tokens
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def context_gradients(rank: int, world: int, port: int, cases: list, seq: int, out: str) -> None:
    """Rank `rank` of `world`, for each (arch, cp) of `cases`: a CP group of cp consecutive
    ranks (world / cp such groups, each computing the same), its chunks' loss and gradients
    summed over the group (what the data-parallel wrapper does); rank 0 saves them by
    `arch-cp`. One spawn for every case: the processes' start is most of the test's time."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.parallel.context import SequenceSplit, apply_context_parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        got = {}
        for arch, cp in cases:
            model = tiny_model(arch, seq)
            mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("groups", "cp"))
            apply_context_parallel(model, mesh["cp"])
            split = SequenceSplit(cp, mesh["cp"].get_local_rank())
            ids, targets = (x.index_select(1, split.indices(seq)) for x in batch(seq))
            loss, grads = loss_and_grads(model, ids, targets, 2 * seq)
            for g in [loss, *grads.values()]:
                dist.all_reduce(g, group=mesh["cp"].get_group())
            got[f"{arch}-{cp}"] = {"loss": loss, "grads": grads}
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()
