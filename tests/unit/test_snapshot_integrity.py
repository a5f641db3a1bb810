"""Snapshot integrity in one process (issue 24): every file checksummed as DCP writes it, a changed
file caught by `verify` and skipped at resume (nothing of it loaded), an old marker without
checksums still used (with one line), a commit that refuses files rank 0 cannot see, and a
snapshot that cannot be written: one warning, nothing lost, the run goes on until
`checkpoint.max_failed_saves` in a row."""

from __future__ import annotations

import json
import subprocess
import zlib

import pytest
import torch

from paratrain.checkpoint import integrity
from paratrain.checkpoint import store as snapshot
from paratrain.cli import main
from paratrain.config import TrainConfig
from paratrain.errors import CheckpointError, ConfigError
from tests.unit.test_checkpoint import _cfg, _fake_snapshot, _parts, _snapshotter, _step


def _run(tmp_path, steps=(2, 4), **ck):
    """A one-process run that saved after each of `steps` (sync); (config, its checkpoints)."""
    cfg = _cfg(tmp_path, every_steps=2, async_save="false", **ck)
    model, opt, sched = _parts(cfg)
    snaps = _snapshotter(cfg, model, opt, sched)
    g = torch.Generator().manual_seed(0)
    for step in range(1, max(steps) + 1):
        _step(model, opt, sched, g)
        if step in steps:
            assert snaps.save(step, {"loss_sum": 0.0, "count": 0.0}) is True
    return cfg, tmp_path / "run" / "checkpoints"


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: the size stays
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("async_save", [True, False])
def test_every_file_is_checksummed_as_it_is_written(tmp_path, async_save):
    cfg = _cfg(tmp_path, every_steps=1, async_save=str(async_save).lower())
    snaps = _snapshotter(cfg, *_parts(cfg))
    snaps.save(1, {"loss_sum": 0.0, "count": 0.0})
    snaps.wait()
    folder = tmp_path / "run" / "checkpoints" / "step-0000001"
    marker = json.loads((folder / snapshot.MARKER).read_text())
    on_disk = {p.name: p for p in folder.iterdir() if p.name != snapshot.MARKER}
    assert marker["checksums"]["algorithm"] == "crc32"
    assert set(marker["checksums"]["files"]) == set(marker["files"]) == set(on_disk)
    for name, p in on_disk.items():  # what was hashed while writing is what reached the disk
        assert marker["checksums"]["files"][name] == f"{zlib.crc32(p.read_bytes()):08x}", name
        assert marker["files"][name] == p.stat().st_size
    assert b"paratrain" not in (folder / ".metadata").read_bytes()  # DCP's index, untouched


def test_verify_names_a_changed_file_and_passes_good_and_old_snapshots(tmp_path, capsys):
    root = tmp_path / "ck"
    _fake_snapshot(root, 4)
    _flip(_fake_snapshot(root, 8, payload=b"y" * 64) / "__0_0.distcp")
    old = _fake_snapshot(root, 12)  # written before checksums: sizes only
    marker = json.loads((old / snapshot.MARKER).read_text())
    del marker["checksums"]
    (old / snapshot.MARKER).write_text(json.dumps(marker))

    assert main(["checkpoint", "verify", str(root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[2:4] for x in lines] == [["4", "ok:"], ["8", "BAD:"], ["12", "ok:"]]
    assert "__0_0.distcp does not match its checksum (crc32 " in lines[1]
    assert "contents cannot be verified" in lines[2]
    assert main(["checkpoint", "verify", str(root / "step-0000004")]) == 0
    store = snapshot.Store(str(root))
    assert store.problem(store.url(8)) is None  # the shards are read at resume, not listed
    assert [s.step for s, _ in store.usable()] == [12, 8, 4]
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(root)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[2].endswith("no checksums (cannot be verified)") and "checksums" not in listed[0]


def test_a_changed_small_file_is_skipped_naming_the_fallback(tmp_path):
    root = tmp_path / "ck"
    _fake_snapshot(root, 4)
    _flip(_fake_snapshot(root, 8) / ".metadata")
    warned = []
    store = snapshot.Store(str(root))
    assert [s.step for s, _ in store.usable(warned.append)] == [4]
    now = f"{zlib.crc32((root / 'step-0000008' / '.metadata').read_bytes()):08x}"
    then = json.loads((root / "step-0000008" / snapshot.MARKER).read_text())["checksums"]
    assert warned == [f"skipping snapshot {store.url(8)}: .metadata does not match its checksum "
                      f"(crc32 {now} now, {then['files']['.metadata']} when it was written); "
                      f"falling back to {store.url(4)}"]


def test_resume_skips_a_changed_snapshot_before_loading_any_of_it(tmp_path, capsys):
    cfg, ck = _run(tmp_path)
    _flip(ck / "step-0000004" / "__0_0.distcp")
    model, opt, sched = _parts(cfg, seed=7)
    resumed = _snapshotter(cfg, model, opt, sched).resume()
    assert resumed is not None and resumed.step == 2
    err = capsys.readouterr().err
    assert (f"warning: skipping snapshot {ck / 'step-0000004'}: __0_0.distcp does not match its "
            "checksum (crc32 ") in err and f"falling back to {ck / 'step-0000002'}" in err

    _flip(ck / "step-0000002" / "__0_0.distcp")  # nothing left to fall back to
    fresh = _parts(cfg, seed=7)[0].state_dict()
    model, opt, sched = _parts(cfg, seed=7)
    assert _snapshotter(cfg, model, opt, sched).resume() is None  # starts over, as when cut short
    assert "no older snapshot to fall back to" in capsys.readouterr().err
    for k, v in model.state_dict().items():  # and nothing of the damaged snapshot was loaded
        assert torch.equal(v, fresh[k]), k


def test_a_damaged_snapshot_is_moved_aside_at_resume_not_deleted(tmp_path, capsys):
    """A snapshot that fails its checksum may have met a transient read error: resume moves it
    to step-N.corrupt (says so), and `checkpoint verify` lists it and how to clear it."""
    cfg, ck = _run(tmp_path)
    _flip(ck / "step-0000004" / "__0_0.distcp")
    kept = (ck / "step-0000004" / "__0_0.distcp").read_bytes()
    assert _snapshotter(cfg, *_parts(cfg, seed=7)).resume().step == 2
    aside = ck / "step-0000004.corrupt"
    assert (aside / "__0_0.distcp").read_bytes() == kept and not (ck / "step-0000004").exists()
    assert f"moved aside to {aside}, not deleted" in capsys.readouterr().err
    assert main(["checkpoint", "verify", str(tmp_path / "run")]) == 0  # step 2 is good
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[2:4] == ["2", "ok:"] and len(out) == 2, out
    assert out[1].startswith(f"{aside}  set aside") and out[1].endswith(f"rm -r {aside}")


def test_a_named_snapshot_that_changed_is_refused(tmp_path):
    cfg, ck = _run(tmp_path, steps=(2,))
    _flip(ck / "step-0000002" / "__0_0.distcp")
    named = cfg.with_overrides([f"checkpoint.resume={ck / 'step-0000002'}"])
    with pytest.raises(CheckpointError, match="no snapshot could be loaded"):
        _snapshotter(named, *_parts(named)).resume()


def test_a_snapshot_without_checksums_resumes_with_one_line(tmp_path, capsys):
    cfg, ck = _run(tmp_path, steps=(2,))
    path = ck / "step-0000002" / snapshot.MARKER
    marker = json.loads(path.read_text())
    del marker["checksums"]
    path.write_text(json.dumps(marker))
    assert _snapshotter(cfg, *_parts(cfg)).resume().step == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if "no checksums" in x]
    assert lines == [f"[paratrain] warning: snapshot {ck / 'step-0000002'} has no checksums "
                     "(written before paratrain recorded them): its sizes were checked, its "
                     "contents cannot be verified"]


def test_commit_refuses_a_file_rank_0_cannot_see(tmp_path):
    """What a node-local checkpoint.dir looks like from rank 0: another rank's shard is absent
    (or not the size its writer wrote). No marker: the snapshot does not count."""
    folder = tmp_path / "ck" / "step-0000002"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"meta")
    (folder / "__0_0.distcp").write_bytes(b"x" * 10)
    written = {".metadata": integrity.Written(4, integrity.checksum_of(b"meta"), 0),
               "__0_0.distcp": integrity.Written(10, integrity.checksum_of(b"x" * 10), 0),
               "__1_0.distcp": integrity.Written(10, integrity.checksum_of(b"x" * 10), 1)}
    store = snapshot.Store(str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match="__1_0.distcp, written by rank 1, is not visible "
                                              "from rank 0 .* every node sees"):
        store.commit(str(folder), {"step": 2}, written)
    (folder / "__1_0.distcp").write_bytes(b"x" * 9)
    with pytest.raises(CheckpointError, match="has 9 bytes, 10 were written"):
        store.commit(str(folder), {"step": 2}, written)
    assert not (folder / snapshot.MARKER).exists()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_snapshot_that_cannot_be_written_warns_and_the_run_goes_on(tmp_path, capsys, async_save):
    """A file where step 4's folder would go makes its write fail (as a full disk or a
    read-only mount does): one warning, no marker, the older snapshot kept (keep_last=1 prunes
    only after a newer commit); a success resets the count; two failures in a row stop."""
    cfg = _cfg(tmp_path, every_steps=2, keep_last=1, max_failed_saves=2,
               async_save=str(async_save).lower())
    snaps = _snapshotter(cfg, *_parts(cfg))
    ck = tmp_path / "run" / "checkpoints"

    def save(step):  # committed?
        done = snaps.save(step, {"loss_sum": 0.0, "count": 0.0})
        return snaps.wait() if async_save else done

    assert save(2)
    for step in (4, 8, 10):
        (ck / snapshot.step_dir(step)).write_text("in the way")
    assert not save(4)
    err = capsys.readouterr().err
    assert err.count("could not be written") == 1
    assert f"warning: snapshot {ck / 'step-0000004'} could not be written (FileExistsError" in err
    assert f"the newest committed snapshot, {ck / 'step-0000002'}, is intact" in err
    store = snapshot.Store(str(ck))
    assert [s.step for s in store.snapshots() if s.committed] == [2]
    assert store.verify(store.url(2))[0]
    assert save(6)  # committed: the count starts again, and keep_last=1 now prunes step 2
    assert [s.step for s in store.snapshots()] == [6]
    assert not save(8)
    with pytest.raises(CheckpointError, match=r"2 snapshot\(s\) in a row could not be written "
                                              r"\(checkpoint.max_failed_saves=2\)"):
        save(10)
    assert [s.step for s in store.snapshots() if s.committed] == [6]


@pytest.fixture
def read_only_mount(tmp_path):
    """(a real tmpfs at tmp_path/ck, a function that remounts it read-only): root does not
    heed chmod, a read-only mount stops everyone. Skipped where this process cannot mount."""
    mnt = tmp_path / "ck"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:100]}); the read-only case "
                    "needs root with CAP_SYS_ADMIN")
    try:
        yield mnt, lambda: subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True,
                                          timeout=30)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], timeout=30)


def test_a_read_only_checkpoint_dir_names_the_newest_intact_snapshot(tmp_path, capsys,
                                                                     read_only_mount):
    """The checkpoint folder goes read-only after step 2's commit, while step 4's folder is
    being written: its removal fails too (errno 30), yet every line names step 2 as intact and
    the run continues from it."""
    mnt, make_read_only = read_only_mount
    cfg = _cfg(tmp_path, every_steps=2, async_save="false", max_failed_saves=2, dir=str(mnt))
    snaps = _snapshotter(cfg, *_parts(cfg))
    assert snaps.save(2, {"loss_sum": 0.0, "count": 0.0}) is True
    (mnt / "step-0000004").mkdir()  # its writer had begun
    (mnt / "step-0000004" / "__0_0.distcp").write_bytes(b"x" * 10)
    make_read_only()
    assert snaps.save(4, {"loss_sum": 0.0, "count": 0.0}) is False
    err = capsys.readouterr().err
    intact = f"the newest committed snapshot, {mnt / 'step-0000002'}, is intact"
    assert intact in err and "no snapshot has been committed" not in err, err
    with pytest.raises(CheckpointError) as e:
        snaps.save(6, {"loss_sum": 0.0, "count": 0.0})
    assert intact in str(e.value) and str(e.value).endswith("continue from it"), e.value
    assert snapshot.Store(str(mnt)).verify(str(mnt / "step-0000002"))[0]


def test_max_failed_saves_must_be_positive():
    with pytest.raises(ConfigError, match="checkpoint.max_failed_saves=0 must be >= 1"):
        TrainConfig.from_yaml(None, ["checkpoint.max_failed_saves=0"])
