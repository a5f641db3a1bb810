"""The optimizer and schedule keys a porting user brings (optim.*): each shape is the one Hugging
Face's schedule functions and torch's LinearLR compute, checked against those very functions."""

from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch

from paratrain.config import OptimConfig, TrainConfig
from paratrain.errors import ConfigError
from paratrain.runtime.optim import (
    build_optimizer,
    build_scheduler,
    lr_at,
    schedule_warnings,
    warmup_steps,
)

T, W, LR = 40, 6, 1e-3


def _hf_lrs(make, **kw) -> list[float]:
    """The learning rates a transformers schedule gives at steps 0..T-1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = make(opt, **kw)
    out = []
    for _ in range(T):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_hf_trainer_schedules_with_start_factor_0_and_min_lr_0():
    tr = pytest.importorskip("transformers")
    cases = {
        "cosine": (tr.get_cosine_schedule_with_warmup,
                   dict(num_warmup_steps=W, num_training_steps=T)),
        "linear": (tr.get_linear_schedule_with_warmup,
                   dict(num_warmup_steps=W, num_training_steps=T)),
        "constant": (tr.get_constant_schedule_with_warmup, dict(num_warmup_steps=W)),
        "wsd": (tr.get_wsd_schedule, dict(num_warmup_steps=W, num_decay_steps=8,
                                          num_training_steps=T)),
    }
    for schedule, (make, kw) in cases.items():
        cfg = OptimConfig(lr=LR, schedule=schedule, warmup_steps=W, warmup_start_factor=0.0,
                          min_lr=0.0, decay_ratio=8 / T)
        ours = [lr_at(k, cfg, T) for k in range(T)]
        theirs = _hf_lrs(make, **kw)
        assert ours == pytest.approx(theirs, abs=1e-12), schedule
    assert ours[0] == 0.0  # HF's warmup: the first step has lr 0


def test_warmup_start_factor_is_torchs_linear_lr():
    cfg = OptimConfig(lr=LR, schedule="constant", warmup_steps=W, warmup_start_factor=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=W)
    for k in range(T):
        assert lr_at(k, cfg, T) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-15)
        opt.step()
        sched.step()


def test_defaults_keep_the_old_schedule():
    """Unset start factor and min_lr: step k of W uses lr (k+1)/W, the floor is lr/10."""
    cfg = OptimConfig(lr=2e-3, warmup_steps=20)
    assert cfg.min_lr is None and cfg.floor_lr == 2e-4
    assert lr_at(0, cfg, 200) == 2e-3 / 20 and lr_at(19, cfg, 200) == pytest.approx(2e-3)
    p = (150 - 20) / (200 - 20)
    assert lr_at(150, cfg, 200) == pytest.approx(2e-4 + 0.5 * 1.8e-3 * (1 + math.cos(math.pi * p)))
    assert lr_at(200, cfg, 200) == pytest.approx(2e-4)


def test_warmup_ratio_and_the_warning_for_a_warmup_that_never_ends():
    cfg = OptimConfig(warmup_steps=1000, warmup_ratio=0.05)
    assert warmup_steps(cfg, 663) == 34  # ceil, as HF rounds it
    assert schedule_warnings(cfg, 663) == []
    long = OptimConfig(warmup_steps=1000)
    (line,) = schedule_warnings(long, 200)
    assert "1000 steps" in line and "200 steps" in line and "optim.warmup_steps" in line


def test_optimizers_and_decay_groups():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cpu = torch.device("cpu")
    groups = build_optimizer(model, OptimConfig(), cpu).param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    every = build_optimizer(model, OptimConfig(decay_norms_and_biases=True), cpu).param_groups
    assert len(every) == 1 and len(every[0]["params"]) == 4 and every[0]["weight_decay"] == 0.1
    assert isinstance(build_optimizer(model, OptimConfig(name="adafactor"), cpu),
                      torch.optim.Adafactor)
    sgd = build_optimizer(model, OptimConfig(name="sgd", momentum=0.9), cpu)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
    fused = build_optimizer(model, OptimConfig(fused=True), cpu)
    assert fused.param_groups[0]["fused"] is True  # torch 2.13 fuses AdamW on CPU too
    for opt in (sgd, fused):  # each one steps, with the scheduler following lr_at
        sched = build_scheduler(opt, OptimConfig(), 10)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(1, OptimConfig(), 10))


def test_optim_keys_are_checked_with_the_fix():
    ok = TrainConfig.from_yaml(None, ["optim.lr=1e-4"])  # the README's old failure
    assert ok.optim.floor_lr == pytest.approx(1e-5)
    bad = {
        "optim.min_lr=0.01": "lr/10",
        "optim.schedule=cosine_with_restarts": "optim.schedule",
        "optim.name=lion": "optim.name",
        "optim.warmup_start_factor=2": "LinearLR",
        "optim.warmup_ratio=1.5": "optim.warmup_ratio",
        "optim.decay_ratio=0": "wsd",
        "optim.name=adamw-8bit": "bitsandbytes",
        "trainer.label_smoothing=1.0": "trainer.label_smoothing",
        "trainer.neftune_noise_alpha=5": "data.format=",
        "model.init=xavier": "model.init",
    }
    if importlib.util.find_spec("bitsandbytes") is not None:  # then adamw-8bit is fine
        del bad["optim.name=adamw-8bit"]
    for override, needle in bad.items():
        with pytest.raises(ConfigError, match=re.escape(needle)) as e:
            TrainConfig.from_yaml(None, [override])
        assert "\n" not in str(e.value)


def test_adamw_8bit_keeps_8bit_moments_and_steps_like_adamw():
    """optim.name=adamw-8bit is bitsandbytes' AdamW8bit, which runs on the CPU as well: the
    moments of a large matrix are uint8 (blockwise-quantized), a small tensor's stay fp32 (its
    min_8bit_size), the decay groups are ours, and five steps move the weights as torch's AdamW
    does within a few percent (8-bit moments, not a different algorithm)."""
    pytest.importorskip("bitsandbytes")
    import copy

    from torch import nn
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(128, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    eight, plain = copy.deepcopy(start), copy.deepcopy(start)
    o8 = build_optimizer(eight, OptimConfig(name="adamw-8bit", lr=1e-2), cpu)
    o = build_optimizer(plain, OptimConfig(lr=1e-2), cpu)
    x = torch.randn(16, 128)
    for _ in range(5):
        for model, opt in ((eight, o8), (plain, o)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    big, small = o8.state[eight[0].weight], o8.state[eight[0].bias]  # 8192 and 64 values
    assert big["state1"].dtype == big["state2"].dtype == torch.uint8
    assert small["state1"].dtype == torch.float32
    assert [g["weight_decay"] for g in o8.param_groups] == \
        [g["weight_decay"] for g in o.param_groups] == [OptimConfig().weight_decay, 0.0]
    for p8, p, p0 in zip(eight.parameters(), plain.parameters(), start.parameters()):
        moved = (p - p0).norm()
        assert moved > 0 and (p8 - p).norm() < 0.05 * moved
