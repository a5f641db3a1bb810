"""Helpers for the snapshot / restart tests: start the CLI without waiting, find its worker
processes, wait for a condition, compare two runs, and one cached uninterrupted reference run per
configuration (shared by the tests that compare against it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.conftest import read_metrics, run_cli, tiny_overrides

# 16 steps of 8 sequences, a snapshot every 4 steps, sample ids recorded.
BASE = {"trainer.devices": "cpu:2", "trainer.batch_size": 4, "trainer.global_batch_size": 8,
        "trainer.max_steps": 16, "trainer.eval_samples": 16, "checkpoint.every_steps": 4,
        "checkpoint.keep_last": 3, "checkpoint.record_samples": "true",
        "distributed.timeout_s": 60}


def args_for(corpus_dir: Path, cache_dir: Path, name: str, **extra) -> list[str]:
    return ["train"] + tiny_overrides(corpus_dir, cache_dir, **{**BASE, "run.name": name,
                                                                 **extra})


def clean_env(extra: dict | None = None) -> dict:
    """The environment run_cli gives a CLI run: no launcher variables, one thread per rank."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC",
                                "GROUP_RANK", "LOCAL_WORLD_SIZE", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **(extra or {}))
    return env


def start_cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """`python -m paratrain ARGS` in a session of its own (so the whole job can be killed)."""
    return subprocess.Popen([sys.executable, "-m", "paratrain"] + args, cwd=cwd,
                            env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"run did not finish in {timeout} s\nstderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_job(proc: subprocess.Popen) -> str:
    """SIGKILL the launcher and every worker at once; return what it printed."""
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    return err


def worker_pids(parent: int) -> list[int]:
    """The elastic agent's worker processes: children of the CLI started by multiprocessing's
    spawn (not its resource tracker)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "spawn_main" in cmd:
            out.append(int(p.name))
    return sorted(out)


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


_REFERENCES: dict[tuple, Path] = {}


def reference_run(tmp_path_factory, corpus_dir: Path, cache_dir: Path, **extra) -> Path:
    """An uninterrupted run of BASE + extra, trained once per test session."""
    key = tuple(sorted((k, str(v)) for k, v in extra.items()))
    if key not in _REFERENCES:
        cwd = tmp_path_factory.mktemp("reference")
        r = run_cli(args_for(corpus_dir, cache_dir, "ref", **extra), cwd=cwd, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        _REFERENCES[key] = cwd / "runs" / "ref"
    return _REFERENCES[key]
