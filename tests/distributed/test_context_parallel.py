"""Context parallelism with real gloo workers, fp32, against one process on the same global batch:
the gradients of one micro-batch (CP=2 and 4, Llama and GPT), then whole runs by the CLI (10
steps of 512-token windows, which the head-tail split cuts into 4 or 8 chunks): CP=2, CP=4,
dp 2 x cp 2 and tp 2 x cp 2 within 1e-5 per step of one process that accumulates the same
global batch as 2 micro-batches; a CP run SIGKILLed after a committed snapshot and started again
is bit-identical, and a CP snapshot resumed on one process within 1e-6. Every run but the
killed one is a session-cached one."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from paratrain.launch.environment import free_port
from tests.conftest import read_metrics, read_summary, run_cli
from tests.distributed import _cp_workers
from tests.distributed._snapshot_helpers import args_for, assert_bit_identical, \
    committed_steps, interrupted_copy, killed_and_rerun, reference_run, samples, weights

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

SEQ = 512
# 10 steps of 4 windows of 512 tokens; a snapshot every 4 steps
CP_BASE = {"data.seq_length": SEQ, "trainer.max_steps": 10, "trainer.global_batch_size": 4,
           "trainer.eval_samples": 6, "checkpoint.every_steps": 4}
# the one process accumulates: 2 micro-batches of 2 windows make the same global batch of 4
ONE = {**CP_BASE, "trainer.devices": "cpu:1", "trainer.batch_size": 2}
CP2 = {**CP_BASE, "trainer.devices": "cpu:2", "trainer.batch_size": 4,
       "trainer.context_parallel": 2}
CP4 = {**CP2, "trainer.devices": "cpu:4", "trainer.context_parallel": 4}
DP2_CP2 = {**CP2, "trainer.devices": "cpu:4", "trainer.batch_size": 2,
           "trainer.strategy": "fsdp"}
TP2_CP2 = {**CP2, "trainer.devices": "cpu:4", "trainer.tensor_parallel": 2}


GRADIENT_CASES = [("llama", 2), ("llama", 4), ("gpt", 2)]  # (arch, CP degree)


def test_gradients_of_a_micro_batch_match_one_process(tmp_path):
    """Every case in one spawn of 4 processes (CP=2 as two groups of 2)."""
    out = str(tmp_path / "cp.pt")
    ctx = mp.start_processes(_cp_workers.context_gradients, nprocs=4, join=False,
                             args=(4, free_port(), GRADIENT_CASES, SEQ, out),
                             start_method="spawn")
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):  # one process at a time
        assert time.monotonic() < deadline, "CP workers did not finish in time"
    got = torch.load(out, weights_only=True)
    ids, targets = _cp_workers.batch(SEQ)
    for arch, cp in GRADIENT_CASES:
        loss, want = _cp_workers.loss_and_grads(_cp_workers.tiny_model(arch, SEQ), ids, targets,
                                                ids.numel())
        case = got[f"{arch}-{cp}"]
        assert abs(float(case["loss"]) - float(loss)) < 1e-6, (arch, cp)
        assert case["grads"].keys() == want.keys()
        for name, g in want.items():
            torch.testing.assert_close(case["grads"][name], g, rtol=0, atol=1e-5,
                                       msg=f"{arch} cp={cp} {name}")
        assert max(g.abs().max() for g in want.values()) > 1e-3  # the check had gradients to see


def _ref(request, layout: dict):
    f = request.getfixturevalue
    return reference_run(f("tmp_path_factory"), f("corpus_dir"), f("cache_dir"),
                         **{"checkpoint.record_samples": "true", **layout})


def _max_step_diff(got_dir, want_dir) -> float:
    got, want = read_metrics(got_dir), read_metrics(want_dir)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    return max(max(abs(a["loss"] - b["loss"]), abs(a["grad_norm"] - b["grad_norm"]))
               for a, b in zip(got, want))


@pytest.mark.parametrize("name,layout,dims,strategy", [
    ("cp2", CP2, {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1}, "ddp+cp"),
    ("cp4", CP4, {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 4, "tp": 1}, "ddp+cp"),
    ("dp2xcp2", DP2_CP2, {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1},
     "fsdp+cp"),
    ("tp2xcp2", TP2_CP2, {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2},
     "fsdp+tp+cp"),
])
def test_context_parallel_run_is_one_process(request, name, layout, dims, strategy):
    one, run = _ref(request, ONE), _ref(request, layout)
    summary = read_summary(run)
    assert summary["parallel_dims"] == dims
    assert summary["strategy"] == strategy  # the layout named from its sizes (test_layout.py)
    assert len(read_metrics(run)) == 10 and samples(run) == samples(one)
    assert _max_step_diff(run, one) < 1e-5
    assert abs(summary["val_loss"] - read_summary(one)["val_loss"]) < 1e-5
    w_run, w_one = weights(run), weights(one)
    for k in w_one:
        torch.testing.assert_close(w_run[k], w_one[k], rtol=0, atol=5e-5, msg=k)


def _resume(request, tmp_path, source, layout: dict, name: str):
    """`layout` continued from `source`'s step-4 snapshot in a copy of its run dir cut there."""
    run = interrupted_copy(source, tmp_path / "runs" / name, keep_until=4)
    f = request.getfixturevalue
    from tests.conftest import tiny_overrides
    args = ["train"] + tiny_overrides(f("corpus_dir"), f("cache_dir"), **{
        **layout, "checkpoint.record_samples": "true", "run.name": name})
    r = run_cli(args, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 4 " in r.stderr
    return run


def test_a_killed_cp_run_started_again_resumes_bit_identical(request, tmp_path):
    """A real CP=2 job SIGKILLed (launcher and workers at once) once a snapshot has committed;
    the same command again resumes from it and ends bit-identical with the uninterrupted run."""
    source = _ref(request, CP2)
    f = request.getfixturevalue
    args = args_for(f("corpus_dir"), f("cache_dir"), "killed", **CP2)
    run_dir = tmp_path / "runs" / "killed"
    killed_and_rerun(args, tmp_path, run_dir, lambda: committed_steps(run_dir / "checkpoints"),
                     "a committed snapshot", wait_s=600, rerun_s=300)
    assert_bit_identical(run_dir, source)


def test_a_cp2_snapshot_resumes_on_one_process(request, tmp_path):
    source, one = _ref(request, CP2), _ref(request, ONE)
    run = _resume(request, tmp_path, source, ONE, "on-one")
    assert read_summary(run)["resumed_from"]["world_size"] == 2
    assert _max_step_diff(run, one) < 1e-5  # the steps before the cut are CP2's own
    got, want = read_metrics(run), read_metrics(source)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got[4:], want[4:])) < 1e-6
