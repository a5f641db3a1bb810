"""The rule for when an existing run dir may be written into, and getting it ready.

A typo must never cost a run: a directory that holds another run is refused unless
`run.overwrite=true`. Not in the way: an unfinished run that `checkpoint.resume` continues from a
committed snapshot, and our own run when the elastic agent restarts its workers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .config import TrainConfig
from .errors import RunDirError
from .fileio import atomic_write_text
from .model_io import MODEL_DIR
from .snapshot_store import Store, root_of

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", MODEL_DIR)
PER_STEP_LOGS = ("metrics.jsonl", "samples.jsonl")  # one JSON line per step; trimmed on resume


def check_run_dir(cfg: TrainConfig, attempt: int = 0) -> None:
    """Refuse to write over another run unless told to (RunDirError, one line)."""
    d = cfg.run_dir
    if d.exists() and not d.is_dir():
        raise RunDirError(f"run.dir {str(d)!r} is a file; choose another run.name or run.dir")
    existing = [f for f in RUN_FILES if (d / f).exists()]
    if existing and not cfg.run.overwrite and attempt == 0 and not continues(cfg, existing):
        if "summary.json" in existing:
            state = "a finished run"
            resume = "; only an unfinished run with a committed snapshot " \
                "(checkpoint.every_steps=N) is continued, by running the same command again"
        elif cfg.checkpoint.resume == "never":
            state, resume = "an unfinished run", " or checkpoint.resume=auto to continue it"
        else:
            state = "an unfinished run without a committed snapshot (nothing to continue from)"
            resume = "; to make a run continuable, take snapshots (checkpoint.every_steps=N): " \
                "the same command then resumes it"
        raise RunDirError(f"run.dir {str(d)!r} already holds {state} ({', '.join(existing)}); "
                          "start a new run with another run.name (Python: run_name=...), or "
                          "replace it with run.overwrite=true (Python: overwrite=True)" + resume)


def continues(cfg: TrainConfig, existing: list[str]) -> bool:
    """Whether a run dir that holds `existing` run files is a run this config continues: it is
    unfinished (no summary.json) and checkpoint.resume names a snapshot, or is `auto` and a
    committed one exists."""
    if "summary.json" in existing or cfg.checkpoint.resume == "never":
        return False
    if cfg.checkpoint.resume != "auto":
        return True
    return any(s.committed for s in Store(root_of(cfg)).snapshots())


def prepare_run_dir(cfg: TrainConfig, resumed_step: Optional[int]) -> Path:
    """Global rank 0, once the resume point is known: per-step logs keep the steps up to it (the
    steps after it run again and are logged again, once); a fresh start (run.overwrite, or a
    restart before any snapshot) begins them anew; the resolved config is written, redacted."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in PER_STEP_LOGS:
        if resumed_step is not None:
            trim_jsonl(run_dir / name, resumed_step)
        else:
            (run_dir / name).unlink(missing_ok=True)
    (run_dir / "summary.json").unlink(missing_ok=True)
    atomic_write_text(run_dir / "config.yaml", cfg.to_yaml(redact=True))
    return run_dir


def trim_jsonl(path: Path, last_step: int) -> None:
    """Drop the lines of a per-step log beyond `last_step`."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    atomic_write_text(path, "".join(line + "\n" for line in keep))


def last_logged_step(run_dir: Path) -> Optional[int]:
    """The step of metrics.jsonl's last complete line (None: no line yet)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a half-written line
    return None


def stopped_message(cfg: TrainConfig) -> str:
    """One line for a run stopped by Ctrl-C: the last step it logged, its newest committed
    snapshot, and what running the same command does next."""
    from .redact import redact_url
    step = last_logged_step(cfg.run_dir)
    total = f" of {cfg.trainer.max_steps}" if cfg.trainer.max_steps else ""
    where = f"after step {step}{total} (the last one logged)" if step is not None else \
        "before the first step was logged"
    try:
        snaps = [s for s in Store(root_of(cfg)).snapshots() if s.committed]
    except Exception:  # an unreachable checkpoint.dir: say what we know
        snaps = []
    if snaps:
        s = snaps[-1]
        how = ("run the same command to resume from it" if cfg.checkpoint.resume != "never"
               else "run the same command with checkpoint.resume=auto to resume from it")
        return (f"{where}; last committed snapshot: {redact_url(s.url)} (step {s.step}); "
                f"{how}")
    if not any((cfg.run_dir / f).exists() for f in RUN_FILES):
        return f"{where}; nothing was written, so the same command starts afresh"
    return (f"{where}; no snapshot was committed (checkpoint.every_steps=N takes them), so "
            "there is nothing to resume: add run.overwrite=true to start again")
