"""A world of processes that does not exist: torch's fake process group, one rank in this
process standing for any of `world`, its collectives returning at once without data. The plan's
simulation (simulate.py) builds the real parallelized model on the meta device inside one, so
every shard it reads is the shard that rank would hold."""

from __future__ import annotations

import contextlib
from typing import Iterator

from ..errors import ConfigError


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0) -> Iterator[None]:
    """The default process group, for the duration, is a fake one of `world` ranks (this one
    `rank`); destroyed on leaving. Refused inside a real distributed job (there is one already)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    if dist.is_initialized():
        raise ConfigError("the simulation needs a process of its own: run `paratrain plan` "
                          "outside torchrun / a distributed job")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches its sharding decisions by mesh layout, keeping this world's meshes, whose
    groups die with it: a later world's equal mesh (built after other groups) must not find
    them."""
    from torch.distributed.tensor import debug
    debug._clear_python_sharding_prop_cache()
    debug._clear_fast_path_sharding_prop_cache()
