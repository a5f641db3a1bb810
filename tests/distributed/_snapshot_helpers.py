"""Helpers for the snapshot / restart tests: find a running job's worker processes, wait for a
condition, compare two runs, and the uninterrupted reference run of a configuration (the
session's cached run, tests/_runs.py, shared by the tests that compare against it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests._runs import tiny_run
# finish, start_cli: conftest's, the one CLI runner (tests that import them from here still can)
from tests.conftest import finish, read_metrics, run_cli, start_cli, tiny_overrides  # noqa: F401

# 16 steps of 8 sequences, a snapshot every 4 steps, sample ids recorded.
BASE = {"trainer.devices": "cpu:2", "trainer.batch_size": 4, "trainer.global_batch_size": 8,
        "trainer.max_steps": 16, "trainer.eval_samples": 16, "checkpoint.every_steps": 4,
        "checkpoint.keep_last": 3, "checkpoint.record_samples": "true",
        "distributed.timeout_s": 60}


def args_for(corpus_dir: Path, cache_dir: Path, name: str, **extra) -> list[str]:
    return ["train"] + tiny_overrides(corpus_dir, cache_dir, **{**BASE, "run.name": name,
                                                                 **extra})


def kill_job(proc: subprocess.Popen) -> str:
    """SIGKILL the launcher and every worker at once; return what it printed."""
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    return err


def worker_pids(parent: int) -> list[int]:
    """The elastic agent's worker processes: the CLI's children started by multiprocessing's
    spawn, or the children of its forkserver (launch/forkserver.py); not its resource tracker."""
    procs = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        procs[int(p.name)] = (ppid, cmd)
    servers = {pid for pid, (ppid, cmd) in procs.items()
               if ppid == parent and "forkserver import main" in cmd}
    return sorted(pid for pid, (ppid, cmd) in procs.items()
                  if ppid == parent and "spawn_main" in cmd or ppid in servers)


def wait_for(cond: Callable[[], object], proc: subprocess.Popen, timeout: float = 120,
             poll: float = 0.02, what: str = "condition") -> object:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}:\n"
                        f"{proc.stderr.read()[-3000:] if proc.stderr else ''}")
        time.sleep(poll)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"timed out waiting for {what}")


def killed_and_rerun(args: list[str], cwd: Path, run_dir: Path, until: Callable[[], object],
                     what: str, wait_s: float = 120, rerun_s: float = 240) -> int:
    """`paratrain ARGS` SIGKILLed whole once `until()` holds (it must have left no summary),
    then the very same command run to its end: the step it resumed from (the newest committed
    snapshot)."""
    proc = start_cli(args, cwd)
    wait_for(until, proc, timeout=wait_s, what=what)
    kill_job(proc)
    newest = committed_steps(run_dir / "checkpoints")[-1]
    assert not (run_dir / "summary.json").exists()
    r = run_cli(args, cwd=cwd, timeout=rerun_s)  # the same command again
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {newest} " in r.stderr
    return newest


def steps_logged(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def committed_steps(ck_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ck_dir.glob("step-*") if (p / "committed.json").is_file())


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(run_dir / "model" / "model.safetensors"))


def assert_bit_identical(run: Path, ref: Path) -> None:
    """Same losses (exactly), same sample ids per step, same final weights (bitwise)."""
    got, want = read_metrics(run), read_metrics(ref)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    assert samples(run) == samples(ref)
    w_got, w_ref = weights(run), weights(ref)
    assert w_got.keys() == w_ref.keys()
    for k in w_ref:
        assert torch.equal(w_got[k], w_ref[k]), k


def samples(run_dir: Path) -> dict[int, list[int]]:
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in rows}) == len(rows), "a step was logged twice"
    return {r["step"]: r["ids"] for r in rows}


def interrupted_copy(ref: Path, dst: Path, keep_until: int) -> Path:
    """A finished run dir turned into one that died after step `keep_until`: no summary, no
    model, no snapshot beyond that step (log lines beyond it stay: the resume must drop them)."""
    shutil.copytree(ref, dst)
    (dst / "summary.json").unlink()
    shutil.rmtree(dst / "model")
    for p in (dst / "checkpoints").glob("step-*"):
        if int(p.name[5:]) > keep_until:
            shutil.rmtree(p)
    return dst


def resume_under(request, tmp_path: Path, source: Path, layout: dict, step: int = 8) -> Path:
    """BASE + `layout` continued from `source`'s step-`step` snapshot (`checkpoint.resume`): the
    run dir of the resumed run, checked to have resumed."""
    args = args_for(request.getfixturevalue("corpus_dir"), request.getfixturevalue("cache_dir"),
                    "resumed", **layout,
                    **{"checkpoint.resume": source / "checkpoints" / f"step-{step:07d}"})
    r = run_cli(args, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {step}" in r.stderr
    return tmp_path / "runs" / "resumed"


def reference_run(tmp_path_factory, corpus_dir: Path, cache_dir: Path, **extra) -> Path:
    """The run dir of an uninterrupted run of BASE + extra (the session's cached run)."""
    return tiny_run(tmp_path_factory, corpus_dir, cache_dir, **{**BASE, **extra}).dir
