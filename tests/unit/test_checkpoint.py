"""Snapshots in one process: the on-disk rules (commit marker, sizes, keep_last), loading that
never unpickles, the Snapshotter's save -> resume round trip (sync and async), export, and the
run-dir rules for resuming."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paratrain.checkpoint import integrity
from paratrain.checkpoint import store as snapshot
from paratrain.checkpoint.rundir import LOCK_FILE, check_run_dir, hold_run_dir, trim_jsonl
from paratrain.checkpoint.snapshotter import Snapshotter
from paratrain.config import ModelConfig, TrainConfig
from paratrain.dist import DistEnv
from paratrain.errors import CheckpointError, ConfigError, RunDirError
from paratrain.models import build_model
from paratrain.models.files import load_model
from paratrain.config.presets import resolve_model_config
from paratrain.parallel.strategies import Parallelism
from paratrain.runplan import RunPlan
from paratrain.runtime.optim import build_optimizer, build_scheduler

ARGS = resolve_model_config(ModelConfig(preset="tiny"), vocab_size=97, seq_length=16)


def _cfg(tmp_path, **ck) -> TrainConfig:
    over = [f"run.dir={tmp_path / 'run'}", "model.preset=tiny"] + \
        [f"checkpoint.{k}={v}" for k, v in ck.items()]
    return TrainConfig.from_yaml(None, over)


def _parts(cfg: TrainConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(ARGS)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    sched = build_scheduler(opt, cfg.optim, total_steps=20)
    return model, opt, sched


def _step(model, opt, sched, g: torch.Generator) -> float:
    idx = torch.randint(0, 97, (2, 16), generator=g)
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _plan(cfg, steps_per_epoch: int = 100, total_steps: int = 20) -> RunPlan:
    return RunPlan(cfg=cfg, devices=("cpu",), nnodes=1, world_size=1, local_world_size=1,
                   parallelism=Parallelism(), parallelism_reason="one process",
                   dims=Parallelism().layout(1), activation_checkpointing=False, precision="fp32", micro_batch=2, accum=1,
                   global_batch=2, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                   cpu_threads=1)


def _snapshotter(cfg, model, opt, sched, **plan) -> Snapshotter:
    return Snapshotter(_plan(cfg, **plan), DistEnv.single(), model, opt, sched, None,
                       model_info=ARGS.to_dict())


def _fake_snapshot(root, step: int, committed: bool = True, payload: bytes = b"x" * 10):
    d = root / snapshot.step_dir(step)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta")
    (d / "__0_0.distcp").write_bytes(payload)
    if committed:
        snapshot.Store(str(root)).commit(str(d), {"step": step}, _written(d))
    return d


def _written(folder) -> dict:
    """What DCP's checksumming writer would report for the files of `folder`."""
    return {p.name: integrity.Written(p.stat().st_size, integrity.checksum_of(p.read_bytes()), 0)
            for p in folder.iterdir()}


# ---- layout ------------------------------------------------------------------------------------
def test_only_step_folders_with_a_marker_are_committed(tmp_path):
    root = tmp_path / "ck"
    _fake_snapshot(root, 4)
    _fake_snapshot(root, 8, committed=False)
    (root / "notes").mkdir()
    (root / "step-12").mkdir()  # too few digits: not ours
    store = snapshot.Store(str(root))
    assert [(s.step, s.committed) for s in store.snapshots()] == [(4, True), (8, False)]
    assert [s.step for s, _ in store.usable()] == [4]
    marker = json.loads((root / "step-0000004" / snapshot.MARKER).read_text())
    assert marker["files"] == {".metadata": 4, "__0_0.distcp": 10}  # every file but itself


def test_truncated_or_missing_file_or_bad_marker_is_reported_and_skipped(tmp_path):
    root = tmp_path / "ck"
    _fake_snapshot(root, 4)
    (_fake_snapshot(root, 8) / "__0_0.distcp").write_bytes(b"x" * 3)
    (_fake_snapshot(root, 12) / ".metadata").unlink()
    (_fake_snapshot(root, 16) / snapshot.MARKER).write_text("{not json")
    store = snapshot.Store(str(root))
    assert "__0_0.distcp has 3 bytes, 10 were written" in store.problem(store.url(8))
    assert ".metadata is missing" in store.problem(store.url(12))
    assert "not committed" in store.problem(store.url(16))
    warned = []
    assert [s.step for s, _ in store.usable(warned.append)] == [4]
    assert [w.split()[2].rsplit("/", 1)[1] for w in warned] == \
        ["step-0000016:", "step-0000012:", "step-0000008:"]  # newest first, each named


def test_keep_last_prunes_older_committed_and_stale_folders_only(tmp_path):
    root = tmp_path / "ck"
    for step in (2, 4, 6):
        _fake_snapshot(root, step)
    _fake_snapshot(root, 3, committed=False)  # a writer died here long ago
    _fake_snapshot(root, 9, committed=False)  # being written right now
    store = snapshot.Store(str(root))
    assert sorted(store.prune(keep_last=2)) == [store.url(2), store.url(3)]
    assert [(s.step, s.committed) for s in store.snapshots()] == [(4, True), (6, True),
                                                                   (9, False)]


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    """A non-tensor value in a snapshot is read with torch's weights-only unpickler: an object
    of an arbitrary class is refused (DCP's own default planner would build it)."""
    path = str(tmp_path / "evil")
    dcp.save({"w": torch.ones(2), "x": _Arbitrary()}, checkpoint_id=path, no_dist=True)
    dst = {"w": torch.zeros(2), "x": None}
    with pytest.raises(BaseException, match="Weights only load failed|Unsupported"):
        dcp.load(dst, checkpoint_id=path, planner=snapshot.SafeLoadPlanner(), no_dist=True)
    ok = {"w": torch.zeros(2)}
    dcp.load(ok, checkpoint_id=path, planner=snapshot.SafeLoadPlanner(), no_dist=True)
    assert torch.equal(ok["w"], torch.ones(2))


class _Arbitrary:
    def __reduce__(self):
        return (pickle.loads, (pickle.dumps("ran"),))


# ---- save -> resume ----------------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [True, False])
def test_resume_continues_bit_identical(tmp_path, async_save):
    cfg = _cfg(tmp_path, every_steps=2, async_save=str(async_save).lower())
    model, opt, sched = _parts(cfg)
    snaps = _snapshotter(cfg, model, opt, sched)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        _step(model, opt, sched, g)
    data_state = g.get_state()
    snaps.save(2, {"loss_sum": 1.5, "count": 3.0})
    torch.manual_seed(123)  # the RNG state the snapshot holds
    expected_rand = torch.rand(3)
    losses = [_step(model, opt, sched, g) for _ in range(3)]
    snaps.wait()  # async: committed only now at the latest
    assert snaps.report()["count"] == 1

    model2, opt2, sched2 = _parts(cfg, seed=99)  # different initial weights: all must load
    resumed = _snapshotter(cfg, model2, opt2, sched2).resume()
    assert resumed is not None and resumed.step == 2 and resumed.world_size == 1
    assert resumed.rank["loss_sum"] == 1.5 and resumed.loop["epoch"] == 0
    assert sched2.last_epoch == 2
    g.set_state(data_state)
    assert [_step(model2, opt2, sched2, g) for _ in range(3)] == losses
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), expected_rand)


def test_async_snapshot_holds_the_state_at_save_time(tmp_path):
    """The loop goes on changing the weights in place while the files are written: the
    snapshot must hold the weights of the step it was taken at."""
    cfg = _cfg(tmp_path, every_steps=1)
    model, opt, sched = _parts(cfg)
    snaps = _snapshotter(cfg, model, opt, sched)
    snaps.save(1, {"loss_sum": 0.0, "count": 0.0})
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    snaps.wait()
    out = snapshot.export_snapshot(str(tmp_path / "run" / "checkpoints"),
                                     tmp_path / "w.safetensors")
    from safetensors.torch import load_file
    got = load_file(str(out))
    for k, v in got.items():
        assert torch.equal(v, at_save[k]), k


def test_export_writes_a_model_folder_load_model_reads(tmp_path):
    cfg = _cfg(tmp_path, every_steps=1, async_save="false")
    model, opt, sched = _parts(cfg)
    _snapshotter(cfg, model, opt, sched).save(1, {"loss_sum": 0.0, "count": 0.0})
    out = snapshot.export_snapshot(str(tmp_path / "run"), tmp_path / "exported")
    loaded, _ = load_model(out)
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k


def test_export_never_overwrites_what_is_at_out_unless_asked(tmp_path, capsys, monkeypatch):
    """A pretraining export into a folder that holds files, onto a file, or onto a .safetensors
    already there is refused in one line (the CLI: exit 2) and OUT is left as it was; with
    --overwrite it is replaced; an export that fails half-way leaves OUT as it was."""
    from tests.conftest import cli_error
    cfg = _cfg(tmp_path, every_steps=1, async_save="false")
    model, opt, sched = _parts(cfg)
    _snapshotter(cfg, model, opt, sched).save(1, {"loss_sum": 0.0, "count": 0.0})
    run = str(tmp_path / "run")
    hf = tmp_path / "hf_model"
    hf.mkdir()
    (hf / "chat_template.jinja").write_text("mine")
    (hf / "config.json").write_text("{}")
    line = cli_error(capsys, ["checkpoint", "export", run, str(hf)])
    assert "already exists and is not empty" in line and "--overwrite" in line, line
    assert sorted(p.name for p in hf.iterdir()) == ["chat_template.jinja", "config.json"]
    (tmp_path / "notes.txt").write_text("mine")
    line = cli_error(capsys, ["checkpoint", "export", run, str(tmp_path / "notes.txt")])
    assert "is a file" in line, line
    assert (tmp_path / "notes.txt").read_text() == "mine"
    (tmp_path / "w.safetensors").write_text("mine")
    line = cli_error(capsys, ["checkpoint", "export", run, str(tmp_path / "w.safetensors")])
    assert "already exists" in line, line
    assert (tmp_path / "w.safetensors").read_text() == "mine"
    assert "holds what is being exported" in cli_error(
        capsys, ["checkpoint", "export", run, str(tmp_path), "--overwrite"])

    import safetensors.torch

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", disk_full)
        with pytest.raises(OSError):
            snapshot.export_snapshot(run, hf, overwrite=True)
    assert sorted(p.name for p in hf.iterdir()) == ["chat_template.jinja", "config.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    snapshot.export_snapshot(run, hf, overwrite=True)
    assert not (hf / "chat_template.jinja").exists() and load_model(hf)[0] is not None
    snapshot.export_snapshot(run, tmp_path / "w.safetensors", overwrite=True)
    assert (tmp_path / "w.safetensors").stat().st_size > 100


def test_export_of_a_finished_run_is_its_final_model_and_every_export_names_its_source(
        tmp_path, capsys):
    """A finished run's final model is newer than any snapshot (none is taken after the last
    step): exporting the run gives it, and says so; a snapshot's export names the snapshot."""
    from paratrain.cli import main
    from paratrain.models.files import save_model
    cfg = _cfg(tmp_path, every_steps=1, async_save="false")
    model, opt, sched = _parts(cfg)
    _snapshotter(cfg, model, opt, sched).save(1, {"loss_sum": 0.0, "count": 0.0})
    run = tmp_path / "run"
    with torch.no_grad():  # trained on after the snapshot
        for p in model.parameters():
            p.add_(1.0)
    save_model(run / "model", model.state_dict(), ARGS.to_dict(), None)
    (run / "summary.json").write_text('{"steps": 2}')
    capsys.readouterr()
    assert main(["checkpoint", "export", str(run), str(tmp_path / "final")]) == 0
    assert "the finished run's final model (model/, step 2)" in capsys.readouterr().out
    for (k, a), b in zip(model.state_dict().items(),
                         load_model(tmp_path / "final")[0].state_dict().values()):
        assert torch.equal(a, b), k
    assert main(["checkpoint", "export", str(run / "checkpoints"), str(tmp_path / "s")]) == 0
    assert f"from snapshot {run / 'checkpoints' / 'step-0000001'}" in capsys.readouterr().out


def test_saves_every_n_steps_and_at_epoch_ends_when_asked_never_after_the_last(tmp_path):
    def saved(**ck):
        cfg = _cfg(tmp_path, **ck)
        snaps = _snapshotter(cfg, *_parts(cfg), steps_per_epoch=6, total_steps=20)
        return [s for s in range(1, 21) if snaps.should_save(s)]
    assert saved(every_steps=4) == [4, 8, 12, 16]  # the default: every_steps alone
    assert saved(every_steps=4, at_epoch_end="true") == [4, 6, 8, 12, 16, 18]
    assert saved(every_steps=0, at_epoch_end="true") == [6, 12, 18]
    assert saved(every_steps=0) == []


def test_resume_never_refuses_foreign_snapshots_and_overwrite_replaces_them(tmp_path):
    cfg = _cfg(tmp_path, every_steps=1, async_save="false")
    model, opt, sched = _parts(cfg)
    _snapshotter(cfg, model, opt, sched).save(1, {"loss_sum": 0.0, "count": 0.0})
    never = _cfg(tmp_path, resume="never")
    with pytest.raises(CheckpointError, match="already holds snapshots"):
        _snapshotter(never, model, opt, sched).resume()
    over = never.with_overrides(["run.overwrite=true"])
    assert _snapshotter(over, model, opt, sched).resume() is None
    assert snapshot.Store(snapshot.root_of(cfg)).snapshots() == []


def test_another_global_batch_is_refused(tmp_path):
    cfg = _cfg(tmp_path, every_steps=1, async_save="false")
    model, opt, sched = _parts(cfg)
    _snapshotter(cfg, model, opt, sched).save(1, {"loss_sum": 0.0, "count": 0.0})
    other = _snapshotter(cfg, model, opt, sched)
    other.info = {**other.info, "global_batch": 4}
    with pytest.raises(ConfigError, match="trainer.global_batch_size=2"):
        other.resume()


def test_a_named_snapshot_must_be_committed(tmp_path):
    root = tmp_path / "elsewhere"
    _fake_snapshot(root, 5, committed=False)
    cfg = _cfg(tmp_path, resume=str(root / "step-0000005"))
    with pytest.raises(CheckpointError, match="not committed"):
        _snapshotter(cfg, *_parts(cfg)).resume()


# ---- run dir rules -----------------------------------------------------------------------------
def test_run_dir_with_an_unfinished_run_and_a_snapshot_is_a_resume(tmp_path):
    cfg = _cfg(tmp_path)
    run = cfg.run_dir
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    # killed before its first snapshot: nothing to resume from, so it starts over
    assert "starting over from step 0" in check_run_dir(cfg)
    assert "starting over" in check_run_dir(cfg.with_overrides(["checkpoint.resume=never"]))
    assert check_run_dir(cfg, attempt=1) is None  # a restarted worker group continues its own run
    _fake_snapshot(run / "checkpoints", 4)
    assert check_run_dir(cfg) is None  # resume=auto and a committed snapshot: resumes
    with pytest.raises(RunDirError, match="checkpoint.resume=auto"):
        check_run_dir(cfg.with_overrides(["checkpoint.resume=never"]))
    (run / "summary.json").write_text("{}")
    with pytest.raises(RunDirError):  # a finished run is not continued
        check_run_dir(cfg)


def test_trim_jsonl_drops_steps_beyond_the_resume_point(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
    trim_jsonl(p, 4)
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2, 3, 4]


def test_a_second_command_on_a_live_run_dir_is_refused_naming_the_holder(tmp_path, capsys):
    """A live run holds its run dir: a second `paratrain train` on it is refused in one line
    naming the holder (exit 2), nothing of the live run touched. The lock is the kernel's: a
    holder killed with SIGKILL leaves its file, and the next command takes the run dir over."""
    from tests.conftest import cli_error
    run = tmp_path / "runs" / "live"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path\n"
        "from paratrain.checkpoint.rundir import hold_run_dir\n"
        "with hold_run_dir(Path(sys.argv[1])):\n    time.sleep(300)"), str(run)])
    try:
        deadline = time.monotonic() + 120
        while f'"pid": {holder.pid}' not in _text(run / LOCK_FILE):
            assert holder.poll() is None and time.monotonic() < deadline, "the holder never held"
            time.sleep(0.05)
        (run / "metrics.jsonl").write_text('{"step": 1}\n')  # the live run's
        line = cli_error(capsys, ["train", f"run.dir={run}", "trainer.devices=cpu:1"])
        assert f"is in use by another paratrain command (pid {holder.pid} on " \
               f"{socket.gethostname()}, since " in line, line
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert (run / LOCK_FILE).is_file()  # left behind by the killed holder: taken over
    with hold_run_dir(run):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (run / LOCK_FILE).exists()  # released, and the file gone with it
    fresh = tmp_path / "never" / "started"
    with hold_run_dir(fresh):
        assert fresh.is_dir()
    assert not (tmp_path / "never").exists()  # a refused run leaves nothing it made


def _text(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
