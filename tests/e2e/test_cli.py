"""The CLI as a user runs it: train with 2 workers, look at the files, generate, torchrun."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import yaml

from tests._runs import LOGGED, Run, tiny_run
from tests.conftest import cli_run, read_metrics, read_summary, run_cli, tiny_overrides

pytestmark = pytest.mark.timeout(300)

METRIC_KEYS = {"step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}
SUMMARY_KEYS = {"steps", "epochs", "final_loss", "val_loss", "wall_s", "tokens_per_s",
                "world_size", "nnodes", "strategy", "precision", "global_batch_size",
                "resumed_from", "memory"}
MEMORY_KEYS = {"rank", "device", "params_bytes", "grads_bytes", "optimizer_bytes", "peak_bytes"}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus_dir, cache_dir) -> Run:
    """One 2-worker run (the session's) shared by the tests that only look at what it left."""
    return tiny_run(tmp_path_factory, corpus_dir, cache_dir, **LOGGED)


def test_run_dir_holds_what_design_lists(trained_run, corpus_dir):
    run_dir, r = trained_run.dir, trained_run
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "model", "summary.json"} <= names
    # and nothing else but the run records of the optional loggers
    assert names - {"config.yaml", "metrics.jsonl", "model", "summary.json"} <= \
        {"report.png", "tensorboard", "checkpoints"}
    assert sorted(p.name for p in (run_dir / "model").iterdir()) == \
        ["config.json", "model.safetensors", "tokenizer.json"]
    # the whole command counted, its start-up too, not the training alone (issue 28)
    import re
    done = re.search(r"done in ([\d.]+) s from the command's start \(([\d.]+) s training\)",
                     r.stderr)
    assert done and float(done[1]) > float(done[2]), r.stderr[-2000:]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["data"]["source"] == str(corpus_dir) and cfg["trainer"]["max_steps"] == 30
    rows = read_metrics(run_dir)
    assert [m["step"] for m in rows] == [5, 10, 15, 20, 25, 30]
    assert all(METRIC_KEYS <= set(m) for m in rows)
    assert [m["step"] for m in rows if "val_loss" in m] == [10, 20]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # the loss visibly falls
    from paratrain.config import TrainConfig
    from paratrain.runtime.optim import lr_at
    optim_cfg = TrainConfig.from_yaml(run_dir / "config.yaml").optim
    # the lr logged at step s is the one step s used: lr_at(s - 1) (lr_at counts from 0)
    assert [m["lr"] for m in rows] == pytest.approx(
        [lr_at(m["step"] - 1, optim_cfg, 30) for m in rows], rel=1e-12)
    s = read_summary(run_dir)
    assert SUMMARY_KEYS <= set(s)
    assert (s["world_size"], s["nnodes"], s["strategy"], s["steps"]) == (2, 1, "ddp", 30)
    assert s["final_loss"] == rows[-1]["loss"] and s["resumed_from"] is None
    assert [m["rank"] for m in s["memory"]] == [0, 1]
    for m in s["memory"]:
        assert MEMORY_KEYS <= set(m)
        assert m["params_bytes"] == 4 * s["params"]  # fp32, DDP: a full replica on each rank
        assert m["grads_bytes"] == m["params_bytes"]
        assert m["optimizer_bytes"] >= 2 * m["params_bytes"]  # AdamW: two moments
        assert m["peak_bytes"] > m["params_bytes"]
    # the data line once: the launching process prepares (or reuses) the token cache, the
    # workers reuse it quietly
    assert r.stderr.count("[paratrain] data: ") == 1, r.stderr
    # the progress bar is drawn once (global rank 0), not once per worker
    assert r.stderr.count("train:   0%") == 1  # each bar prints its empty state once
    assert "train: 100%" in r.stderr
    assert "final loss" in r.stdout


def test_saved_model_reproduces_validation_loss(trained_run, cache_dir):
    """The consolidated weights are the trained ones: reloading them gives the run's own
    validation loss."""
    from paratrain import TrainConfig, load_model
    from paratrain.data import EvalSampler, build_dataset, collate, prepare_data
    run_dir = trained_run.dir
    cfg = TrainConfig.from_yaml(run_dir / "config.yaml")
    model, tok = load_model(run_dir)
    prepared = prepare_data(cfg.data, cfg.cache_dir, log=lambda m: None)
    val = build_dataset(prepared, "val", cfg.data, packed=cfg.task_spec.packed)
    n = min(len(val), 64)
    batch = collate([val[i] for i in EvalSampler(n, 1, 0)])
    with torch.no_grad():
        logits = model(batch["input_ids"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    assert abs(loss.item() - read_summary(run_dir)["val_loss"]) < 1e-4
    assert tok.vocab_size == cfg.data.vocab_size


def test_generate_prints_a_continuation(trained_run, capsys, monkeypatch):
    """Seeded; on OMP_NUM_THREADS threads, as a one-process training run (2 OpenMP threads
    where 1 was asked for made each token spin on a busy machine)."""
    import torch
    run_dir = trained_run.dir
    threads = []
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch, "set_num_threads", lambda n, real=torch.set_num_threads: (
        threads.append(n), real(n))[1])
    r = cli_run(capsys, ["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "30"])
    assert r.returncode == 0, r.stderr
    assert threads[0] == 1, threads  # (cli_run puts this process's own count back after)
    assert r.stdout.startswith("def ") and len(r.stdout) > len("def ") + 10
    again = cli_run(capsys, ["generate", run_dir, "--prompt", "def ", "--max-new-tokens", "30"])
    assert again.stdout == r.stdout  # seeded


def test_config_show(tmp_path, capsys):
    r = cli_run(capsys, ["config", "show", "trainer.max_steps=7"])
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert shown["trainer"]["max_steps"] == 7 and shown["model"]["arch"] == "llama"


@pytest.mark.slow
def test_torchrun_launch(tmp_path, corpus_dir, cache_dir):
    """`torchrun --standalone --nproc_per_node=2 -m paratrain train ...`: each process is one
    rank, nothing is launched twice, only rank 0 writes."""
    args = ["train"] + tiny_overrides(corpus_dir, cache_dir, **{"run.name": "tr"})
    r = run_cli(args, cwd=tmp_path, timeout=240, launcher=[
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "paratrain"])
    assert r.returncode == 0, r.stderr[-3000:]
    s = read_summary(tmp_path / "runs" / "tr")
    assert s["world_size"] == 2 and s["strategy"] == "ddp"
    assert len(read_metrics(tmp_path / "runs" / "tr")) == 10  # one writer, not two
    assert r.stdout.count("final loss") == 1


API_SCRIPT = """
import json, sys
from paratrain import Trainer
from paratrain import TrainConfig

if __name__ == "__main__":
    cfg = TrainConfig.from_yaml(None, sys.argv[1:])
    result = Trainer(cfg, devices="cpu:2", strategy="ddp").fit()
    # one write per line: two ranks share this stdout under torchrun
    sys.stdout.write("RESULT " + json.dumps({"loss": result.final_loss, "master": result.is_master,
                     "world": result.summary["world_size"], "steps": result.steps}) + "\\n")
"""


@pytest.mark.slow
@pytest.mark.parametrize("under_torchrun", [False, True])
def test_python_api_same_script_both_ways(tmp_path, corpus_dir, cache_dir, under_torchrun):
    script = tmp_path / "train_api.py"
    script.write_text(API_SCRIPT)
    args = tiny_overrides(corpus_dir, cache_dir, **{"run.name": "api"})
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"] if under_torchrun else [sys.executable]
    r = run_cli([str(script)] + args, cwd=tmp_path, timeout=240, launcher=launcher)
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines()
               if line.startswith("RESULT ")]
    # fit() returns in the calling process; under torchrun each rank's fit() returns
    assert len(results) == (2 if under_torchrun else 1)
    master = [x for x in results if x["master"]]
    assert len(master) == 1 and master[0]["world"] == 2 and master[0]["steps"] == 10
    assert master[0]["loss"] == read_summary(tmp_path / "runs" / "api")["final_loss"]


def test_script_without_main_guard_gets_a_clear_error(tmp_path, corpus_dir, cache_dir):
    script = tmp_path / "unguarded.py"
    script.write_text(API_SCRIPT.replace('if __name__ == "__main__":\n', "if True:\n"))
    args = tiny_overrides(corpus_dir, cache_dir, **{"run.name": "unguarded"})
    r = run_cli([str(script)] + args, cwd=tmp_path, timeout=120, launcher=[sys.executable])
    assert r.returncode != 0
    assert "if __name__ == '__main__':" in r.stderr
