"""FSDP2 against DDP with 2 real gloo workers: the same run, half the state per rank, a model that
comes back whole; mixed precision, activation checkpointing, CPU offload, and the memory plan
checked against what the runs measured."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from paratrain import TrainConfig, load_model
from paratrain.parallel.memory_estimate import estimates_for_config
from tests._runs import TWO_WORKERS, tiny_run
from tests.conftest import read_metrics, read_summary

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _run(tmp_path_factory, corpus_dir, cache_dir, **extra):
    """The session's run of 2 workers, a global batch of 8 and `extra` (strategy auto: ddp here;
    without extra it is `TWO_WORKERS`, the run test_ddp.py and others compare against too)."""
    run = tiny_run(tmp_path_factory, corpus_dir, cache_dir, **{**TWO_WORKERS, **extra})
    return read_metrics(run.dir), read_summary(run.dir), run.dir, run.overrides


@pytest.fixture(scope="module")
def ddp_and_fsdp(tmp_path_factory, corpus_dir, cache_dir):
    return {"ddp": _run(tmp_path_factory, corpus_dir, cache_dir),
            "fsdp": _run(tmp_path_factory, corpus_dir, cache_dir, **{"trainer.strategy": "fsdp"})}


def test_fsdp_and_ddp_give_the_same_run(ddp_and_fsdp):
    (m_ddp, s_ddp, _, _), (m_fsdp, s_fsdp, _, _) = ddp_and_fsdp["ddp"], ddp_and_fsdp["fsdp"]
    assert s_fsdp["strategy"] == "fsdp" and s_ddp["strategy"] == "ddp"
    assert len(m_ddp) == len(m_fsdp) == 10
    for a, b in zip(m_ddp, m_fsdp):
        assert abs(a["loss"] - b["loss"]) < 1e-5
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5  # the global norm across shards
    assert abs(s_ddp["val_loss"] - s_fsdp["val_loss"]) < 1e-5


def test_fsdp_holds_half_the_state(ddp_and_fsdp):
    def state(m):
        return m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
    s_ddp, s_fsdp = ddp_and_fsdp["ddp"][1], ddp_and_fsdp["fsdp"][1]
    for d, f in zip(s_ddp["memory"], s_fsdp["memory"]):
        assert state(f) <= 0.52 * state(d), (f, d)


def test_fsdp_model_is_saved_whole_and_loads_on_one_device(ddp_and_fsdp):
    _, _, ddp_dir, _ = ddp_and_fsdp["ddp"]
    _, s_fsdp, fsdp_dir, _ = ddp_and_fsdp["fsdp"]
    w_ddp = load_file(str(ddp_dir / "model" / "model.safetensors"))
    w_fsdp = load_file(str(fsdp_dir / "model" / "model.safetensors"))
    assert w_ddp.keys() == w_fsdp.keys()
    for k in w_ddp:  # full (unsharded) tensors, equal to the DDP run's trained weights
        assert w_fsdp[k].shape == w_ddp[k].shape
        torch.testing.assert_close(w_fsdp[k], w_ddp[k], rtol=0, atol=1e-5)
    model, _ = load_model(fsdp_dir)
    assert sum(p.numel() for p in model.parameters()) == s_fsdp["params"]


def test_plan_matches_what_the_runs_measured(ddp_and_fsdp):
    """State within 5%, activations within 25% of the measured saved-for-backward bytes."""
    _, s_ddp, _, over = ddp_and_fsdp["ddp"]
    _, s_fsdp, _, _ = ddp_and_fsdp["fsdp"]
    cfg = TrainConfig.from_yaml(None, [o for o in over if not o.startswith("data.vocab")]
                                + ["data.vocab_size=384", "trainer.batch_size=4"])
    rows, _, _ = estimates_for_config(cfg, world=2)
    by = {r.label: r for r in rows}
    for name, measured in (("ddp", s_ddp["memory"][0]), ("fsdp", s_fsdp["memory"][0])):
        row = by[name]
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert abs(getattr(row, key) - measured[key]) <= 0.05 * measured[key], (name, key)
        act = measured["activation_bytes"]
        assert abs(row.activation_bytes - act) <= 0.25 * act, (name, row.activation_bytes, act)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_mixed_stays_close_to_fp32(tmp_path_factory, corpus_dir, cache_dir, ddp_and_fsdp,
                                        strategy):
    fp32 = ddp_and_fsdp[strategy][0]
    bf16, s, _, _ = _run(tmp_path_factory, corpus_dir, cache_dir,
                         **{"trainer.strategy": strategy, "trainer.precision": "bf16-mixed"})
    assert s["precision"] == "bf16-mixed"
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(fp32, bf16)) < 2e-2


def test_activation_checkpointing_same_loss_less_memory(tmp_path_factory, corpus_dir, cache_dir):
    """Big enough activations (seq 256, batch 8) that the difference shows in peak RSS too."""
    runs = {}
    for ac in ("false", "true"):
        runs[ac] = _run(tmp_path_factory, corpus_dir, cache_dir, **{
            "trainer.strategy": "fsdp", "trainer.activation_checkpointing": ac,
            "model.preset": "small", "data.seq_length": 256, "trainer.batch_size": 8,
            "trainer.global_batch_size": 16, "trainer.max_steps": 2, "trainer.eval_samples": 8})
    (m0, s0, _, _), (m1, s1, _, _) = runs["false"], runs["true"]
    assert s1["activation_checkpointing"] is True and s0["activation_checkpointing"] is False
    for a, b in zip(m0, m1):
        assert abs(a["loss"] - b["loss"]) < 1e-6
    for r0, r1 in zip(s0["memory"], s1["memory"]):
        assert r1["activation_bytes"] < 0.25 * r0["activation_bytes"]
        assert r1["peak_bytes"] < r0["peak_bytes"]


def test_cpu_offload_trains_the_same(tmp_path_factory, corpus_dir, cache_dir, ddp_and_fsdp):
    fsdp = ddp_and_fsdp["fsdp"][0]
    off, s, _, _ = _run(tmp_path_factory, corpus_dir, cache_dir,
                        **{"trainer.strategy": "fsdp", "trainer.cpu_offload": "true"})
    assert s["cpu_offload"] is True
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(fsdp, off)) < 1e-5
