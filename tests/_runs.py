"""The session's trained runs: each configuration is trained once, by the real CLI, and every test
that only reads a finished run of it gets the same one.

Under pytest-xdist the cache spans the workers (tests/_shared.py): the first worker that asks
for a run trains it under a lock in the session's shared folder, the others wait and read it.
The key is the resolved configuration (defaults filled in, run.name/run.dir left out), so two
tests that spell the same run differently (a default given or not) still share it. The runs are
read only: a test that changes a run dir (deletes, renames, resumes into it) works on a copy.

Standard runs several files compare against (the tiny model of `tiny_overrides`, 10 steps, a
global batch of 8, 37 validation windows: odd, so uneven over 2 and 4 ranks):
`ONE_WORKER` (one process) and `TWO_WORKERS` (2 CPU workers, strategy auto: ddp here).
`LOGGED`: 2 workers, 30 steps, a log line every 5 and an evaluation every 10, the progress bar
on: the run whose records test_cli.py and test_report.py read.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from tests._shared import held, session_root
from tests.conftest import run_cli, tiny_overrides

ONE_WORKER = {"trainer.devices": "cpu:1", "trainer.batch_size": 8,
              "trainer.global_batch_size": 8, "trainer.eval_samples": 37}
TWO_WORKERS = {"trainer.devices": "cpu:2", "trainer.batch_size": 4,
               "trainer.global_batch_size": 8, "trainer.eval_samples": 37}
LOGGED = {"trainer.devices": "cpu:2", "trainer.max_steps": 30, "trainer.log_every": 5,
          "trainer.eval_every": 10, "trainer.eval_samples": 64, "trainer.progress_bar": True,
          "optim.lr": 3e-3, "log.report": True, "log.tensorboard": True}


@dataclass(frozen=True)
class Run:
    """A finished `paratrain train` run: its run dir, where the command ran, the overrides it
    was given (without run.dir) and what it printed."""
    dir: Path
    cwd: Path
    overrides: list[str]
    stdout: str
    stderr: str
    env: Optional[dict] = None  # the environment beside cli_env's, for a rerun of the command


_RUNS: dict[str, Run] = {}


def trained_run(tmp_path_factory, overrides: Mapping[str, object], timeout: float = 240,
                env: Optional[dict] = None) -> Run:
    """`paratrain train KEY=VALUE...` trained once per session; the run dir is the cache's own.
    `env`: variables the command needs beside cli_env's (not part of the key: they must not
    change what the run computes, only let it find what it reads)."""
    over = [f"{k}={v}" for k, v in overrides.items()]
    assert not any(o.startswith(("run.dir=", "run.name=")) for o in over), \
        "the cache names its runs; leave run.dir and run.name out"
    key = _key(over)
    if key not in _RUNS:
        cwd, stdout, stderr = _trained_once(tmp_path_factory, over, key, timeout, env)
        _RUNS[key] = Run(cwd / "run", cwd, over, stdout, stderr, env)
    return _RUNS[key]


def _trained_once(tmp_path_factory, over: list[str], key: str, timeout: float,
                  env: Optional[dict]) -> tuple[Path, str, str]:
    """(where it ran, stdout, stderr) of the session's run of `key`, trained here unless a
    worker did it first (a failed training leaves no record: the next asker tries again)."""
    root = session_root(tmp_path_factory) / "runs"
    root.mkdir(exist_ok=True)
    name = hashlib.sha1(key.encode()).hexdigest()[:16]
    record = root / f"{name}.json"
    with held(root / f"{name}.lock"):
        if not record.exists():
            cwd = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
            r = run_cli(["train"] + over + [f"run.dir={cwd / 'run'}"], cwd=cwd, timeout=timeout,
                        env=env)
            assert r.returncode == 0, r.stderr[-3000:]
            written = record.with_suffix(".tmp")
            written.write_text(json.dumps({"cwd": str(cwd), "stdout": r.stdout,
                                           "stderr": r.stderr}))
            written.rename(record)
    saved = json.loads(record.read_text())
    return Path(saved["cwd"]), saved["stdout"], saved["stderr"]


def tiny_run(tmp_path_factory, corpus_dir: Path, cache_dir: Path, timeout: float = 240,
             **extra) -> Run:
    """The tiny model on the corpus (`tiny_overrides`) with `extra`, trained once per session."""
    base = tiny_overrides(corpus_dir, cache_dir, **extra)
    return trained_run(tmp_path_factory, dict(o.split("=", 1) for o in base), timeout)


def _key(overrides: list[str]) -> str:
    """What the run computes: its whole resolved configuration but the run's name and place."""
    from paratrain.config import TrainConfig
    resolved = TrainConfig.from_yaml(None, overrides).to_dict()
    resolved.pop("run")
    return json.dumps(resolved, sort_keys=True, default=str)
