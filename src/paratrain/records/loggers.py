"""Run records besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow, and report.png.

Each sink receives the same records as metrics.jsonl, on global rank 0 only (every other rank
gets a `RunRecords` with no sinks, so the loop has no rank checks of its own). None of the
packages is required: TensorBoard is on by default when it is installed, W&B and MLflow only
when switched on, and switching on a package that is missing is a one-line ConfigError before
any worker starts, not a traceback halfway through a run.

`train()` owns the lifecycle: `RunRecords.open` before the loop, `write` per logged step (through
`metrics.MetricsLog`), `finish(summary)` once summary.json is written (memory per rank, then
report.png), `close` in its `finally` (idempotent, so a failed run still flushes its events).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import shutil
import time
from pathlib import Path
from typing import Optional

from ..config.sections import LogConfig
from ..config.tree import TrainConfig
from ..dist import DistEnv
from ..errors import ConfigError
from ..formatting import flatten
from ..redact import redact_secrets
from .console import log

TB_DIR = "tensorboard"
# metrics.jsonl key -> scalar tag; TensorBoard groups tags by the part before the slash
TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr",
        "grad_norm": "train/grad_norm", "tokens_per_s": "perf/tokens_per_s",
        "step_time_s": "perf/step_time_s", "data_wait_s": "perf/data_wait_s",
        "epoch": "train/epoch"}
MEMORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes",
               "peak_bytes")
_PIP = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def tensorboard_enabled(cfg: LogConfig) -> bool:
    """log.tensorboard=null means: on when the tensorboard package is there."""
    return installed("tensorboard") if cfg.tensorboard is None else cfg.tensorboard


def check_log_config(cfg: LogConfig) -> None:
    """Every sink switched on must be importable: say which package and how to get it."""
    wanted = [name for name, on in (("tensorboard", cfg.tensorboard is True),
                                    ("wandb", cfg.wandb), ("mlflow", cfg.mlflow)) if on]
    for name in wanted:
        if not installed(name):
            raise ConfigError(f"log.{name}=true but the {name} package is not installed; "
                              f"pip install {_PIP[name]} (or set log.{name}=false)")


def scalars(record: dict) -> dict[str, float]:
    """The numeric, finite values of one metrics record, under their scalar tags."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):  # a task's validation figures (val_accuracy) go under val/
            default = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
            out[TAGS.get(key, default)] = float(value)
    return out


def memory_scalars(summary: dict) -> dict[str, float]:
    """memory/rank<r>/<what>_mb for each rank of summary.json's `memory` list."""
    out = {}
    for entry in summary.get("memory") or []:
        for key in MEMORY_KEYS:
            if entry.get(key) is not None:
                out[f"memory/rank{entry['rank']}/{key[:-6]}_mb"] = entry[key] / 2**20
    return out


# ---- sinks: write(step, scalars), close() ------------------------------------------------------
class TensorBoardSink:
    """Event files under <run dir>/tensorboard/. A fresh start clears what an overwritten run
    left there; a resumed run purges the events after its snapshot, which it logs again."""

    def __init__(self, run_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter
        logdir = run_dir / TB_DIR
        if start_step == 0:
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            _after_existing_events(logdir)
        self._w = SummaryWriter(str(logdir), purge_step=start_step + 1 if start_step else None)

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, v in values.items():
            self._w.add_scalar(tag, v, step)
        self._w.flush()  # a running run is readable at once, like metrics.jsonl

    def close(self) -> None:
        self._w.close()


def _after_existing_events(logdir: Path) -> None:
    """Wait (under a second) until a new event file's name sorts after every file in `logdir`.

    TensorBoard reads a folder's event files in name order, and a resumed run's purge of the
    steps after its snapshot applies only to the events read before it. Names start with the
    second they were made, then host, pid and a per-process counter compared as text ("10" <
    "9"), so a writer made in the same second as the last one (a run resumed in the same
    process, as a notebook does) could sort first and see its purge undone."""
    # events.out.tfevents.<seconds>.<host>...: the fourth dot-separated field
    fields = [p.name.split(".")[3] for p in logdir.glob("events.out.tfevents.*")]
    stamps = [int(f) for f in fields if f.isdigit()]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)


class WandbSink:
    def __init__(self, cfg: TrainConfig, run_dir: Path):
        self._wandb = importlib.import_module("wandb")
        self._run = self._wandb.init(project=cfg.log.project or "paratrain", name=cfg.run.name,
                                     dir=str(run_dir), config=redact_secrets(cfg.to_dict()))

    def write(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    def __init__(self, cfg: TrainConfig):
        self._mlflow = importlib.import_module("mlflow")
        self._mlflow.set_experiment(cfg.log.project or "paratrain")
        self._run = self._mlflow.start_run(run_name=cfg.run.name)
        self._mlflow.log_params({k: str(v)[:500] for k, v in
                                 flatten(redact_secrets(cfg.to_dict())).items()})

    def write(self, step: int, values: dict[str, float]) -> None:
        # MLflow metric names may not hold every character TensorBoard tags do
        self._mlflow.log_metrics({k.replace("/", "."): v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


class RunRecords:
    """The sinks of one run on one rank (none except on global rank 0)."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, sinks: list):
        self.cfg, self.env, self.sinks = cfg, env, sinks
        self._last_step = 0

    @classmethod
    def open(cls, cfg: TrainConfig, env: DistEnv, start_step: int = 0) -> "RunRecords":
        if not env.is_master:
            return cls(cfg, env, [])
        check_log_config(cfg.log)
        sinks: list = []
        try:
            if tensorboard_enabled(cfg.log):
                sinks.append(TensorBoardSink(cfg.run_dir, start_step))
            if cfg.log.wandb:
                sinks.append(WandbSink(cfg, cfg.run_dir))
            if cfg.log.mlflow:
                sinks.append(MlflowSink(cfg))
        except BaseException:
            for s in sinks:
                s.close()
            raise
        return cls(cfg, env, sinks)

    def write(self, record: dict) -> None:
        """One metrics.jsonl record (must hold `step`)."""
        if self.sinks:
            self._last_step = int(record["step"])
            values = scalars(record)
            for s in self.sinks:
                s.write(self._last_step, values)

    def finish(self, summary: dict) -> Optional[Path]:
        """After summary.json: memory per rank as scalars at the last step, close the sinks,
        draw report.png (when log.report and matplotlib is there). Returns the PNG, if any."""
        if not self.env.is_master:
            return None
        mem = memory_scalars(summary)
        for s in self.sinks:
            s.write(int(summary.get("steps") or self._last_step), mem)
        self.close()
        if not self.cfg.log.report:
            return None
        if not installed("matplotlib"):
            log(self.env, "no report.png: matplotlib is not installed "
                          "(pip install 'paratrain[report]')")
            return None
        from .report import write_report
        try:
            return write_report(self.cfg.run_dir)
        except Exception as e:  # a drawing problem must not fail a run that has finished
            log(self.env, f"no report.png: {type(e).__name__}: {e}")
            return None

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for s in sinks:
            try:
                s.close()
            except Exception as e:  # a failed flush must not hide the run's own error
                log(self.env, f"closing {type(s).__name__} failed: {e}")
