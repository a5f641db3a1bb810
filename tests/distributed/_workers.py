"""Worker functions for tests that start ranks themselves (torch.multiprocessing.spawn pickles
them by module name, so they live in a module, not in a test function)."""

from __future__ import annotations

import os

import torch

from paratrain.dist import DistEnv
from paratrain.models import build_model
from paratrain.config.presets import ModelArgs
from paratrain.parallel.parallelize import parallelize
from paratrain.parallel.strategies import DDP


def ddp_replicas(rank: int, world: int, port: int, result_path: str) -> None:
    """Train a few DDP steps with different data on each rank; save every rank's parameters."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a long collective timeout: the parent's wait (tests/_progress.py) ends a hung run, and a
    # loaded machine may keep one rank from its first collective for minutes
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                  device=torch.device("cpu"), backend="gloo", timeout_s=600)
    torch.set_num_threads(1)
    env.init()
    try:
        args = ModelArgs(**{**_tiny(), "vocab_size": 97, "max_seq_length": 16})
        torch.manual_seed(0)
        ddp = DDP()
        model = parallelize(build_model(args), ddp, env, precision="fp32")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(100 + rank)  # each rank sees different tokens
        for step in range(4):
            for micro in range(2):  # accumulate: the first micro-step must not sync
                ctx = ddp.no_sync(model) if micro == 0 else torch.enable_grad()
                with ctx:
                    idx = torch.randint(0, 97, (3, 16), generator=g)
                    logits = model(idx)
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                             idx.roll(-1, 1).flatten())
                    loss.backward()
            opt.step()
            opt.zero_grad()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        torch.save(flat, f"{result_path}.{rank}")
        del model, opt
    finally:
        env.teardown()


def _tiny() -> dict:
    from paratrain.config import ModelConfig
    from paratrain.config.presets import resolve_model_config
    return resolve_model_config(ModelConfig(preset="tiny"), vocab_size=97,
                                seq_length=16).to_dict()


def resave_snapshot(rank: int, world: int, port: int, overrides: list[str]) -> None:
    """Today's code on `world` gloo ranks, with the run plan of `overrides`: load the snapshot
    `checkpoint.resume` names, then save that same state again as this run's snapshot of the
    same step, as a run writes its snapshots (the state, the loop's and every rank's)."""
    from paratrain.checkpoint.snapshotter import Snapshotter
    from paratrain.config import TrainConfig
    from paratrain.runplan import make_plan
    from paratrain.runtime.rank import _build, prepare_task
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = TrainConfig.from_yaml(None, overrides)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                  device=torch.device("cpu"), backend="gloo", timeout_s=60)
    torch.set_num_threads(1)
    env.init()
    model = optimizer = snapshots = None
    try:
        task = prepare_task(cfg, env, quiet=True)  # the token cache is there already
        plan = make_plan(cfg, task, devices=[env.device] * world, world_size=world,
                         local_world_size=world)
        model, optimizer, scheduler, scaler, *_ = _build(plan, env, task)
        snapshots = Snapshotter(plan, env, model, optimizer, scheduler, scaler,
                                model_info=task.model_info, tokenizer_path=task.tokenizer_path)
        resumed = snapshots.resume()
        assert resumed is not None and resumed.rank is not None
        snapshots.save(resumed.step, resumed.rank, blocking=True)
    finally:
        del model, optimizer, snapshots  # a live wrapped model at teardown can abort
        env.teardown()


def host_group_checks(rank: int, world: int, port: int, result_path: str) -> None:
    """runtime/host_group.py on 2 gloo ranks: rank 1 notes signal 15 from the third stop check
    on; every rank's answers and a blocking sum go to result_path.RANK (JSON)."""
    import json

    from paratrain.runtime.host_group import HostGroup
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                  device=torch.device("cpu"), backend="gloo", timeout_s=60)
    env.init()
    try:
        host = HostGroup(env)
        signums = [0, 0, 15, 15, 15] if rank == 1 else [0] * 5
        seen = [host.stop_agreed(s) for s in signums]
        total = host.sum([rank + 1.0, 2.5])
        host.drain()
        with open(f"{result_path}.{rank}", "w") as f:
            json.dump({"seen": seen, "sum": total}, f)
    finally:
        env.teardown()
