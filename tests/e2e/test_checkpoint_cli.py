"""`paratrain checkpoint inspect|export` as a user runs them, on the snapshots of a real 2-worker
run."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.conftest import cli_error, cli_run, run_cli, tiny_overrides
from tests.distributed._snapshot_helpers import reference_run

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, corpus_dir, cache_dir):
    return reference_run(tmp_path_factory, corpus_dir, cache_dir)


@pytest.mark.slow
def test_inspect_lists_and_describes_snapshots(ref, tmp_path, capsys):
    r = cli_run(capsys, ["checkpoint", "inspect", str(ref)])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [line.split()[2] for line in lines] == ["4", "8", "12"]
    assert all(" committed " in line for line in lines)

    step = ref / "checkpoints" / "step-0000012"
    r = cli_run(capsys, ["checkpoint", "inspect", str(step)])
    assert r.returncode == 0, r.stderr
    assert "step 12, committed" in r.stdout and "saved by 2 worker(s), strategy ddp" in r.stdout
    r = cli_run(capsys, ["checkpoint", "inspect", "--json", str(step)])
    d = json.loads(r.stdout)
    names = {t["name"] for t in d["tensors"]}
    assert "model.tok_embeddings.weight" in names
    assert any(n.startswith("optim.state.") and n.endswith("exp_avg") for n in names)
    emb = next(t for t in d["tensors"] if t["name"] == "model.tok_embeddings.weight")
    assert emb["bytes"] == 4 * emb["shape"][0] * emb["shape"][1]

    torn = tmp_path / "torn" / "step-0000012"  # a copy without its commit marker
    shutil.copytree(step, torn)
    (torn / "committed.json").unlink()
    r = cli_run(capsys, ["checkpoint", "inspect", str(torn)])
    assert r.returncode == 0 and "NOT committed" in r.stdout and "tensors" not in r.stdout


@pytest.mark.slow
def test_export_gives_a_model_that_generates(ref, tmp_path, capsys):
    out = tmp_path / "exported"
    r = cli_run(capsys, ["checkpoint", "export", ref / "checkpoints" / "step-0000008", out])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out} from snapshot {ref / 'checkpoints'}/step-0000008")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "tokenizer.json"]
    r = cli_run(capsys, ["generate", str(out), "--max-new-tokens", "8"])
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    single = tmp_path / "one.safetensors"  # a finished run dir: its final model, not a snapshot
    r = cli_run(capsys, ["checkpoint", "export", str(ref), str(single)])
    assert r.returncode == 0 and single.is_file(), r.stderr
    assert "the finished run's final model (model/, step " in r.stdout, r.stdout
    assert single.read_bytes() == (ref / "model" / "model.safetensors").read_bytes()


def test_checkpoint_errors_are_one_line(tmp_path, capsys):
    """In this process, through cli.main (test_errors.py checks a real process's exit code)."""
    line = cli_error(capsys, ["checkpoint", "export", str(tmp_path / "nothing"),
                              str(tmp_path / "o")], only_line=True)
    assert "holds no committed snapshot" in line


@pytest.mark.slow  # two runs with periodic and epoch-end snapshots: ~15 s idle
@pytest.mark.parametrize("at_epoch_end", [False, True])
def test_epoch_end_snapshots_are_asked_for_and_every_commit_is_one_line(
        tmp_path, corpus_dir, cache_dir, at_epoch_end):
    """Short epochs (a few steps each), a snapshot every 10 steps, the progress bar on: epoch-end
    snapshots only with checkpoint.at_epoch_end=true, and each commit (made by a background
    thread) logged once, on a line of its own."""
    r = run_cli(["train"] + tiny_overrides(corpus_dir, cache_dir, **{
        "trainer.devices": "cpu:2", "trainer.batch_size": 16, "data.max_bytes": 8000,
        "trainer.max_steps": 30, "checkpoint.every_steps": 10, "checkpoint.keep_last": 2,
        "checkpoint.at_epoch_end": str(at_epoch_end).lower(), "trainer.progress_bar": "true",
        "run.name": "epochs"}), cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    per_epoch = int(re.search(r"\((\d+) per epoch\)", r.stderr).group(1))
    assert per_epoch < 10  # several epoch ends between the every-10-steps snapshots
    want = [s for s in range(1, 30) if s % 10 == 0 or at_epoch_end and s % per_epoch == 0]
    # a line as a terminal shows it: what follows the last carriage return
    lines = [x.rsplit("\r", 1)[-1] for x in r.stderr.split("\n")]
    commits = [x for x in lines if re.search(r"snapshot \S+ committed", x)]
    assert [int(re.search(r"step-(\d+)", x).group(1)) for x in commits] == want, r.stderr
    assert all(x.startswith("[paratrain] snapshot ") for x in commits), commits
