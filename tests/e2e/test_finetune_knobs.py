"""Issue 22's fixes as a user meets them, through the CLI and the Python API with real processes:
bad fine-tuning input refused in one line before anything is read (exit 2), a changed setting
named when an unfinished run's snapshot cannot be loaded, and data.drop_last=false: the epoch's
short last step is one more step, exact whatever the split into workers and micro-batches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import cli_error, cli_refusal, read_metrics, tiny_overrides
from tests.e2e._tiny_model import make_pairs, write_jsonl

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, pairs_llama) -> Path:
    """A user's folder: my-model/ (a tiny local Llama, 256 positions) and train.jsonl."""
    here = tmp_path_factory.mktemp("user")
    shutil.copytree(pairs_llama, here / "my-model")  # the session's (conftest), on its pairs
    write_jsonl(here / "train.jsonl", make_pairs(120))
    return here


def _train(*extra: str) -> list[str]:
    return ["train", "model.arch=hf", "model.path=./my-model", "data.format=pairs",
            "data.source=train.jsonl", "data.cache_dir=./cache", "trainer.devices=cpu",
            "trainer.max_steps=4", "trainer.progress_bar=false", *extra]


def test_bad_fine_tuning_input_is_refused_before_the_data_is_read(folder, tmp_path, monkeypatch,
                                                                 capsys):
    """Each kind of error in one line, exit 2, nothing written; in this process, through the same
    cli.main (test_errors.py checks the exit code of a real process)."""
    work = tmp_path / "work"
    shutil.copytree(folder, work)
    monkeypatch.chdir(work)
    line = cli_error(capsys, _train("data.max_length=100000"))
    assert "data.max_length=100000" in line and "max_position_embeddings=256" in line
    line, err = cli_refusal(capsys, _train("model.lora.r=8",
                                           "model.lora.target_modules=[q_proj,value]"))
    assert "'value' matches no module" in line and "v_proj" in line
    assert "rows ->" not in err  # refused before the records were encoded
    weights = work / "my-model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # a download cut short
    line = cli_error(capsys, _train())
    assert "my-model/model.safetensors are damaged" in line
    assert not (work / "runs").exists()


@pytest.mark.slow
def test_rerun_with_a_changed_lora_rank_names_the_setting(folder, tmp_path, monkeypatch,
                                                          capfd):
    """LoRA r=4 with snapshots, stopped after its step-2 snapshot; the same run again with
    model.lora.r=8 says which setting differs from the snapshot's (not "damaged"), and with
    r=4 it resumes. Also: a warmup as long as the run is warned about."""
    pytest.importorskip("peft")
    from paratrain import Trainer
    from paratrain.errors import CheckpointError
    from tests.distributed._snapshot_helpers import interrupted_copy
    monkeypatch.chdir(folder)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = [json.loads(x) for x in Path("train.jsonl").read_text().splitlines()]

    def fit(rank: int, run_dir: Path):
        return Trainer(model="./my-model", train_data=rows, devices="cpu", max_steps=4,
                       warmup_steps=10, progress_bar=False, run_dir=str(run_dir),
                       overrides=[f"model.lora.r={rank}", "checkpoint.every_steps=2"]).fit()

    fit(4, tmp_path / "done")
    assert "the warmup (10 steps) is as long as the run (4 steps)" in capfd.readouterr().err
    stopped = interrupted_copy(tmp_path / "done", tmp_path / "stopped", keep_until=2)
    shutil.rmtree(stopped / "adapter")
    with pytest.raises(CheckpointError) as e:
        fit(8, stopped)
    msg = str(e.value)
    assert "model.lora.r=4 in the snapshot, 8 now" in msg and "another run.name" in msg, msg
    assert "damaged" not in msg and "\n" not in msg
    assert fit(4, stopped).steps == 4
    assert "resumed from step 2" in capfd.readouterr().err


@pytest.mark.slow
def test_short_last_step_is_exact_on_one_and_two_workers(folder, tmp_path, monkeypatch):
    """36 examples, global batch 16, data.drop_last=false: 3 steps an epoch (16, 16, 4); over 2
    epochs the short steps leave micro-batches empty (1 worker x 8 x 2 micro-steps: [4], [];
    2 workers x 4 x 2: [2], [] each). Same per-step losses, every example once per epoch."""
    from paratrain import Trainer
    from tests.distributed._snapshot_helpers import samples
    monkeypatch.chdir(folder)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = [json.loads(x) for x in Path("train.jsonl").read_text().splitlines()][:36]
    losses = {}
    for devices, batch in (("cpu", 8), ("cpu:2", 4)):
        run_dir = tmp_path / f"{devices.replace(':', '')}-{batch}"
        result = Trainer(model="./my-model", train_data=rows, devices=devices, batch_size=batch,
                         global_batch_size=16, max_steps=6, log_every=1, progress_bar=False,
                         lr=3e-3, run_dir=str(run_dir),
                         overrides=["data.drop_last=false", "data.val_fraction=0",
                                    "checkpoint.record_samples=true"]).fit()
        assert result.summary["epochs"] == 2.0
        losses[(devices, batch)] = [m["loss"] for m in read_metrics(run_dir)]
        ids = samples(run_dir)
        assert [len(ids[s]) for s in range(1, 7)] == [16, 16, 4] * 2
        for epoch in (range(1, 4), range(4, 7)):
            assert sorted(i for s in epoch for i in ids[s]) == list(range(36))
    one = losses[("cpu", 8)]
    for key, other in losses.items():
        assert max(abs(a - b) for a, b in zip(one, other)) < 1e-5, (key, one, other)


@pytest.mark.slow
def test_short_last_step_of_a_packed_corpus_counts_its_windows(corpus_dir, cache_dir, tmp_path,
                                                               monkeypatch):
    """A corpus (a fixed number of tokens per window): drop_last=false adds the short step;
    splitting it into micro-batches (one of them empty) does not change the losses."""
    from paratrain import TrainConfig, Trainer
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    losses = []
    for batch in (8, 2):
        cfg = TrainConfig.from_yaml(None, tiny_overrides(corpus_dir, cache_dir, **{
            "trainer.devices": "cpu", "trainer.batch_size": batch,
            "trainer.global_batch_size": 8, "trainer.max_steps": "null", "trainer.epochs": 1,
            "data.drop_last": "false", "data.max_bytes": 6_000,
            "run.dir": str(tmp_path / f"b{batch}")}))
        result = Trainer(cfg).fit()
        windows = result.summary["tokens"] // 32
        assert result.steps == -(-windows // 8) and windows % 8, windows  # a short last step
        losses.append([m["loss"] for m in read_metrics(tmp_path / f"b{batch}")])
    assert max(abs(a - b) for a, b in zip(*losses)) < 1e-5, losses


@pytest.mark.slow
def test_adamw_8bit_snapshots_its_8bit_moments_and_resumes_bit_identical(folder, tmp_path,
                                                                          monkeypatch):
    """optim.name=adamw-8bit (bitsandbytes; on the CPU too): a full fine-tune whose snapshots
    hold the optimizer's uint8 moments, loaded back without unpickling; stopped after its step-2
    snapshot and run again, it ends bit-identical to the uninterrupted run."""
    pytest.importorskip("bitsandbytes")
    from torch.distributed.checkpoint import FileSystemReader

    from paratrain import Trainer
    from tests.distributed._snapshot_helpers import assert_bit_identical, interrupted_copy
    monkeypatch.chdir(folder)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = [json.loads(x) for x in Path("train.jsonl").read_text().splitlines()]

    def fit(run_dir: Path):
        return Trainer(model="./my-model", train_data=rows, devices="cpu", max_steps=4,
                       batch_size=8, log_every=1, lr=3e-3, warmup_steps=1, progress_bar=False,
                       run_dir=str(run_dir),
                       overrides=["optim.name=adamw-8bit", "checkpoint.every_steps=2",
                                  "checkpoint.record_samples=true"]).fit()

    done = tmp_path / "done"
    assert fit(done).steps == 4
    meta = FileSystemReader(str(done / "checkpoints" / "step-0000002")).read_metadata()
    moments = {k: str(v.properties.dtype) for k, v in meta.state_dict_metadata.items()
               if k.endswith((".state1", ".state2")) and hasattr(v, "size")}
    assert "torch.uint8" in moments.values(), sorted(moments)[:4]
    stopped = interrupted_copy(done, tmp_path / "stopped", keep_until=2)
    assert fit(stopped).steps == 4
    assert_bit_identical(stopped, done)


@pytest.mark.slow
def test_a_run_continued_to_its_snapshots_step_writes_the_model(folder, tmp_path, monkeypatch,
                                                                 capfd):
    """Continued from a snapshot to that snapshot's own step (checkpoint.resume=SNAPSHOT,
    trainer.max_steps=its step), a run trains nothing and writes model/ from the snapshot. No
    loss was logged before that step (trainer.log_every=10), so the closing lines leave the
    final loss out; they used to stop on it with a TypeError after writing the model."""
    from paratrain import cli
    monkeypatch.chdir(folder)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    done, at2 = tmp_path / "done", tmp_path / "at2"
    assert cli.main(_train("checkpoint.every_steps=2", f"run.dir={done}")) == 0
    capfd.readouterr()
    snapshot = done / "checkpoints" / "step-0000002"
    assert cli.main(_train(f"checkpoint.resume={snapshot}", "trainer.max_steps=2",
                           f"run.dir={at2}")) == 0
    out, err = capfd.readouterr()
    assert "resumed from step 2" in err and "Traceback" not in err, err[-3000:]
    assert out.startswith("validation loss ") and "final loss" not in out, out
    assert json.loads((at2 / "summary.json").read_text())["final_loss"] is None
    assert (at2 / "model" / "model.safetensors").is_file()
