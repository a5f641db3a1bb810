"""Optimizer groups and the learning-rate schedule."""

import math

import torch

from paratrain.config import OptimConfig
from paratrain.runtime.optim import build_optimizer, build_scheduler, lr_at


def test_schedule_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    lrs = [lr_at(s, cfg, 100) for s in range(100)]
    assert lrs[0] == 1e-4  # (0 + 1) / 10 of the peak
    assert math.isclose(lrs[9], 1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # rising
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then falling
    assert math.isclose(lr_at(100, cfg, 100), 1e-4)  # floor at the end
    assert lrs[55] > 1e-4 and math.isclose(lr_at(55, cfg, 100), 1e-4 + 0.5 * 9e-4, rel_tol=1e-9)


def test_scheduler_follows_lr_at():
    model = torch.nn.Linear(4, 4)
    cfg = OptimConfig(lr=2e-3, min_lr=0.0, warmup_steps=3)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = build_scheduler(opt, cfg, 20)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == [lr_at(s, cfg, 20) for s in range(20)]


def test_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 4))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.dim() for p in decay["params"]} == {2}
    assert {p.dim() for p in no_decay["params"]} == {1}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
