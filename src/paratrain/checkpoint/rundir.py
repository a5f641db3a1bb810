"""The rule for when an existing run dir may be written into, and getting it ready.

A typo must never cost a run: a directory that holds a finished run is refused unless
`run.overwrite=true`. The same command after any kill goes on: an unfinished run continues from
its newest committed snapshot or, with none, starts over; and the elastic agent's restarted
workers continue their own run. While a run lives it holds its run dir (`hold_run_dir`): a second
command on the same run dir is refused instead of writing into the live run's files.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator, Optional

from ..config.tree import TrainConfig
from ..errors import RunDirError
from ..fileio import atomic_write_text
from ..models.files import MODEL_DIR
from .store import Store, root_of

LOCK_FILE = ".paratrain.lock"  # held while a run lives; names its holder (pid, host)
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", MODEL_DIR)
PER_STEP_LOGS = ("metrics.jsonl", "samples.jsonl")  # one JSON line per step; trimmed on resume


def check_run_dir(cfg: TrainConfig, attempt: int = 0) -> Optional[str]:
    """Refuse to write over another run unless told to (RunDirError, one line). Returns a line
    to log when the run dir holds an unfinished run that starts over.

    The same command always goes on: an unfinished run (no summary.json) continues from its
    newest committed snapshot, or, killed before its first one, starts over from step 0 (it
    holds nothing worth keeping). Refused: a finished run, and an unfinished one with snapshots
    that `checkpoint.resume=never` says not to use."""
    d = cfg.run_dir
    if d.exists() and not d.is_dir():
        raise RunDirError(f"run.dir {str(d)!r} is a file; choose another run.name or run.dir")
    existing = [f for f in RUN_FILES if (d / f).exists()]
    if not existing or cfg.run.overwrite or attempt > 0:
        return None
    ways = ("start a new run with another run.name (Python: run_name=...), or replace it with "
            "run.overwrite=true (Python: overwrite=True)")
    if "summary.json" in existing:
        raise RunDirError(
            f"run.dir {str(d)!r} already holds a finished run ({', '.join(existing)}); {ways}; "
            "only an unfinished run is continued, by running the same command again (it resumes "
            "from its newest committed snapshot: checkpoint.every_steps=N takes them)")
    mode = cfg.checkpoint.resume
    if mode not in ("auto", "never"):  # a named snapshot: resume from it
        return None
    if any(s.committed for s in Store(root_of(cfg)).snapshots()):
        if mode == "auto":
            return None
        raise RunDirError(
            f"run.dir {str(d)!r} already holds an unfinished run with committed snapshots "
            f"({', '.join(existing)}) and checkpoint.resume=never; pass checkpoint.resume=auto "
            f"to continue it, or {ways}")
    return (f"run.dir {d} holds an unfinished run with no committed snapshot (stopped before "
            "its first one): starting over from step 0")


@contextlib.contextmanager
def hold_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir` for the life of this block; RunDirError (one line naming the holder) when
    another live command holds it. A POSIX record lock (fcntl) on LOCK_FILE: the kernel drops it
    when the holder exits in any way (kill -9 too), so a run dir whose holder is gone is taken
    over by the next command; forked workers do not inherit it. On leaving, the file goes, and
    the run dir too when this block made it and nothing else was written there."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        yield  # nothing to hold: check_run_dir refuses it
        return
    made = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # deepest first
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = _lock(path, run_dir)
    try:
        os.write(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n").encode())
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock goes: a waiter then finds a fresh file
        os.close(fd)  # releases the lock
        with contextlib.suppress(OSError):  # only empty ones: a run refused leaves nothing
            for d in made:
                d.rmdir()


def _lock(path: Path, run_dir: Path) -> int:
    """An fd holding the lock on the file now at `path` (a holder that left may have removed
    the file we opened: then try the new one)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EAGAIN / EACCES: a live process holds it
            os.close(fd)
            raise RunDirError(
                f"run.dir {str(run_dir)!r} is in use by another paratrain command "
                f"({_holder(path)}); wait for it to end or stop it (the same command then "
                "continues the run), or pass another run.name") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.ftruncate(fd, 0)
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on {h['host']}, since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that is still starting"


# Keys whose change makes a snapshot's tensors not fit this run: the model's shape and adapters,
# and which parameters the optimizer holds and how (its state's layout).
STATE_SHAPING = ("model.", "data.tokenizer", "data.vocab_size", "optim.name",
                 "optim.decay_norms_and_biases")


def unloadable_message(tried: list[tuple[str, dict]], cfg: TrainConfig) -> str:
    """The line for snapshots that exist but none of which loaded (`tried`: (url, marker) pairs,
    newest first). When a setting that shapes the saved state differs from the newest snapshot's,
    that is the cause: name it, and the two ways on; else the snapshots are damaged."""
    from ..formatting import flatten
    from ..redact import redact_url
    url, marker = tried[0]
    head = f"no snapshot could be loaded (tried {len(tried)}, newest {redact_url(url)})"
    saved, now = flatten(marker.get("config") or {}), flatten(cfg.to_dict())
    changed = [k for k in sorted(set(saved) & set(now))  # keys older versions lacked: skipped
               if k.startswith(STATE_SHAPING) and saved[k] != now[k]]
    if not changed:
        return (f"{head}; remove the damaged ones or pass checkpoint.resume=never with another "
                "run.dir")
    settings = "; ".join(f"{k}={saved[k]} in the snapshot, {now[k]} now"
                         for k in changed[:4])
    return (f"{head}: it was saved with other settings ({settings}); to continue it, run with "
            "the snapshot's settings; to start a new run instead, pass another run.name (Python: "
            "run_name=...), or run.overwrite=true to replace this one")


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
    atomic_write_text(run_dir / "config.yaml", cfg.to_yaml(redact=True, record_task=True))
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
    """One line for a run stopped by Ctrl-C, naming one step: the one its newest committed
    snapshot holds (the stop's own, taken after the step every rank finished), or without
    one the last step it logged; and what running the same command does next."""
    from ..redact import redact_url
    total = f" of {cfg.trainer.max_steps}" if cfg.trainer.max_steps else ""
    try:
        snaps = [s for s in Store(root_of(cfg)).snapshots() if s.committed]
    except Exception:  # an unreachable checkpoint.dir: say what we know
        snaps = []
    if snaps:
        s = snaps[-1]
        how = ("run the same command to resume from it" if cfg.checkpoint.resume != "never"
               else "run the same command with checkpoint.resume=auto to resume from it")
        return (f"after step {s.step}{total}; last committed snapshot: {redact_url(s.url)}; "
                f"{how}")
    step = last_logged_step(cfg.run_dir)
    where = f"after step {step}{total} (the last one logged)" if step is not None else \
        "before the first step was logged"
    if not any((cfg.run_dir / f).exists() for f in RUN_FILES):
        return f"{where}; nothing was written, so the same command starts afresh"
    return (f"{where}; no snapshot was committed, so the same command starts over from step 0 "
            "(checkpoint.every_steps=N takes snapshots)")
