"""`paratrain checkpoint inspect|export` as a user runs them, on the snapshots of a real 2-worker
run."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_cli
from tests.distributed._snapshot_helpers import reference_run

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, corpus_dir, cache_dir):
    return reference_run(tmp_path_factory, corpus_dir, cache_dir)


def test_inspect_lists_and_describes_snapshots(ref, tmp_path):
    r = run_cli(["checkpoint", "inspect", str(ref)], cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [line.split()[2] for line in lines] == ["4", "8", "12"]
    assert all(" committed " in line for line in lines)

    step = ref / "checkpoints" / "step-0000012"
    r = run_cli(["checkpoint", "inspect", str(step)], cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "step 12, committed" in r.stdout and "saved by 2 worker(s), strategy ddp" in r.stdout
    r = run_cli(["checkpoint", "inspect", "--json", str(step)], cwd=tmp_path, timeout=60)
    d = json.loads(r.stdout)
    names = {t["name"] for t in d["tensors"]}
    assert "model.tok_embeddings.weight" in names
    assert any(n.startswith("optim.state.") and n.endswith("exp_avg") for n in names)
    emb = next(t for t in d["tensors"] if t["name"] == "model.tok_embeddings.weight")
    assert emb["bytes"] == 4 * emb["shape"][0] * emb["shape"][1]

    torn = tmp_path / "torn" / "step-0000012"  # a copy without its commit marker
    shutil.copytree(step, torn)
    (torn / "committed.json").unlink()
    r = run_cli(["checkpoint", "inspect", str(torn)], cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and "NOT committed" in r.stdout and "tensors" not in r.stdout


def test_export_gives_a_model_that_generates(ref, tmp_path):
    out = tmp_path / "exported"
    r = run_cli(["checkpoint", "export", str(ref / "checkpoints" / "step-0000008"), str(out)],
                cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "tokenizer.json"]
    r = run_cli(["generate", str(out), "--max-new-tokens", "8"], cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    single = tmp_path / "one.safetensors"  # the newest committed snapshot of a run dir
    r = run_cli(["checkpoint", "export", str(ref), str(single)], cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and single.is_file(), r.stderr


def test_checkpoint_errors_are_one_line(tmp_path):
    r = run_cli(["checkpoint", "export", str(tmp_path / "nothing"), str(tmp_path / "o")],
                cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "holds no committed snapshot" in r.stderr
