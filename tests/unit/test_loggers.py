"""loggers and report without processes: what each sink is handed, the errors, the drawing."""

from __future__ import annotations

import json
import sys
import types

import pytest

from paratrain.config import LogConfig, TrainConfig
from paratrain.dist import DistEnv
from paratrain.errors import ConfigError, ParatrainError
from paratrain.records import loggers


def test_scalars_and_memory():
    rec = {"step": 5, "epoch": 0, "loss": 2.5, "lr": 1e-3, "val_loss": float("nan"),
           "grad_norm": None, "tokens_per_s": 100}
    assert loggers.scalars(rec) == {"train/epoch": 0.0, "train/loss": 2.5, "train/lr": 1e-3,
                                    "perf/tokens_per_s": 100.0}
    mem = loggers.memory_scalars({"memory": [{"rank": 1, "params_bytes": 2**20,
                                              "activation_bytes": None}]})
    assert mem == {"memory/rank1/params_mb": 1.0}


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_switched_on_but_missing_is_one_line(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # find_spec then reports it missing
    with pytest.raises(ConfigError) as e:
        loggers.check_log_config(LogConfig(**{name: True}))
    msg = str(e.value)
    assert "\n" not in msg and f"log.{name}=true" in msg and f"pip install {name}" in msg


def test_tensorboard_default_follows_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert loggers.tensorboard_enabled(LogConfig()) is False
    loggers.check_log_config(LogConfig())  # null: quietly off


def test_log_section_from_overrides():
    cfg = TrainConfig.from_yaml(overrides=["log.tensorboard=false", "log.project=p"])
    assert cfg.log.tensorboard is False and cfg.log.project == "p" and cfg.log.report
    with pytest.raises(ConfigError, match="unknown config key"):
        TrainConfig.from_yaml(overrides=["log.nope=1"])


def test_wandb_and_mlflow_sinks_get_the_records(monkeypatch, tmp_path):
    calls: list = []
    run = types.SimpleNamespace(log=lambda v, step: calls.append(("wandb", step, v)),
                                finish=lambda: calls.append(("wandb", "finish")))
    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("wandb", "init", kw)) or run)
    mlflow = types.SimpleNamespace(
        set_experiment=lambda name: calls.append(("mlflow", "experiment", name)),
        start_run=lambda run_name: calls.append(("mlflow", "start", run_name)),
        log_params=lambda p: calls.append(("mlflow", "params", len(p))),
        log_metrics=lambda m, step: calls.append(("mlflow", step, m)),
        end_run=lambda: calls.append(("mlflow", "end")))
    monkeypatch.setattr(loggers, "installed", lambda name: name != "matplotlib")
    monkeypatch.setattr(loggers.importlib, "import_module",
                        lambda name: {"wandb": wandb, "mlflow": mlflow}[name])
    cfg = TrainConfig.from_yaml(overrides=[
        f"run.dir={tmp_path}", "run.name=x", "log.tensorboard=false", "log.wandb=true",
        "log.mlflow=true", "log.project=proj"])
    rec = loggers.RunRecords.open(cfg, DistEnv(), start_step=0)
    rec.write({"step": 3, "loss": 1.5})
    rec.finish({"steps": 3, "memory": [{"rank": 0, "peak_bytes": 2**21}]})
    rec.close()  # idempotent after finish
    assert calls[0][:2] == ("wandb", "init") and calls[0][2]["project"] == "proj"
    assert ("wandb", 3, {"train/loss": 1.5}) in calls
    assert ("mlflow", 3, {"train.loss": 1.5}) in calls
    assert ("mlflow", 3, {"memory.rank0.peak_mb": 2.0}) in calls
    assert calls.count(("wandb", "finish")) == 1 and calls.count(("mlflow", "end")) == 1


def test_other_ranks_have_no_sinks(tmp_path):
    cfg = TrainConfig.from_yaml(overrides=[f"run.dir={tmp_path}", "log.tensorboard=true"])
    rec = loggers.RunRecords.open(cfg, DistEnv(rank=1, world_size=2), start_step=0)
    assert rec.sinks == [] and rec.finish({"steps": 1}) is None
    assert not (tmp_path / "tensorboard").exists()


def test_report_of_a_running_and_a_finished_run(tmp_path):
    pytest.importorskip("matplotlib")
    from paratrain.records.report import write_report
    rows = [{"step": s, "loss": 5 - s / 10, "lr": 1e-3, "tokens_per_s": 1000.0 + s}
            for s in range(1, 11)]
    rows[4]["val_loss"] = 4.7
    rows[5]["loss"] = None  # a NaN loss, as metrics.jsonl writes it
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11, "lo')  # torn last line
    png = write_report(tmp_path)  # running: no summary.json
    assert png == tmp_path / "report.png" and png.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "summary.json").write_text(json.dumps({
        "steps": 10, "world_size": 2, "strategy": "ddp", "precision": "fp32",
        "final_loss": 4.0, "val_loss": 4.7,
        "memory": [{"rank": r, "device": "cpu", "params_bytes": 2**20, "grads_bytes": 2**20,
                    "optimizer_bytes": 2**21, "activation_bytes": None,
                    "peak_bytes": 2**28} for r in range(2)]}))
    out = write_report(tmp_path, tmp_path / "sub" / "r.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ParatrainError, match="no metrics.jsonl"):
        write_report(tmp_path / "sub")


def test_tensorboard_resume_replaces_the_steps_after_the_snapshot(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    # the two writers' files get counters 9 and 10 (the tenth and eleventh writers of a
    # process): made in the same second, "...10" sorts before "...9" and TensorBoard would read
    # the resumed run's file first (what a CI run of the whole suite once hit)
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))

    def losses() -> dict:
        ea = EventAccumulator(str(tmp_path / loggers.TB_DIR))
        ea.Reload()
        return {e.step: e.value for e in ea.Scalars("train/loss")}

    first = loggers.TensorBoardSink(tmp_path, start_step=0)
    for step in range(1, 9):
        first.write(step, {"train/loss": float(step)})
    first.close()  # the run dies after step 8; its last snapshot is step 4
    again = loggers.TensorBoardSink(tmp_path, start_step=4)
    for step in range(5, 11):
        again.write(step, {"train/loss": 100.0 + step})
    again.close()
    assert losses() == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, **{s: 100.0 + s for s in range(5, 11)}}
    fresh = loggers.TensorBoardSink(tmp_path, start_step=0)  # run.overwrite: a new run
    fresh.write(1, {"train/loss": 7.0})
    fresh.close()
    assert losses() == {1: 7.0}
