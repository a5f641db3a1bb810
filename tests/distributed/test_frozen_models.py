"""The seam for models a task runs but does not train (DPO's reference, a distillation teacher):
a task of the test's own, through `Trainer(task=...)`, with 2 real FSDP workers. The teacher is
sharded like the trained model, never changes (checked by the task on every micro-step), stays
out of the optimizer and the snapshots, is counted in the memory table, and the run equals one
process's."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, read_metrics, read_summary, run_cli

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # 4 processes with a teacher: ~15 s idle

SCRIPT = """
import json, sys
sys.path.insert(0, {repo!r})
from paratrain import Trainer
from tests.distributed._distill import DistillTask, inputs, make_mlp

if __name__ == "__main__":
    for devices, strategy in (("cpu:2", "fsdp"), ("cpu:1", "single")):
        task = DistillTask(make_mlp, inputs(256, 0), inputs(40, 1))
        r = Trainer(task=task, devices=devices, strategy=strategy, max_steps=12, batch_size=4,
                    global_batch_size=16, log_every=1, eval_every=1000, lr=1e-2,
                    warmup_steps=2, run_dir="runs/" + strategy, progress_bar=False,
                    verbose=True, overrides=["checkpoint.every_steps=6"]).fit()
        sys.stdout.write("RESULT " + json.dumps({{"val": r.val_loss}}) + "\\n")
"""


def test_a_frozen_teacher_is_sharded_unchanged_and_left_out_of_state(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from tests.distributed._distill import make_mlp
    script = tmp_path / "distill.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    r = run_cli([str(script)], cwd=tmp_path, timeout=240, launcher=[sys.executable])
    assert r.returncode == 0, r.stderr[-3000:]
    fsdp, single = tmp_path / "runs" / "fsdp", tmp_path / "runs" / "single"
    a, b = read_metrics(fsdp), read_metrics(single)
    assert a[-1]["loss"] < 0.5 * a[0]["loss"]  # the student learns the teacher
    assert [x["loss"] for x in a] == pytest.approx([x["loss"] for x in b], abs=1e-5)
    vals = [json.loads(line[7:])["val"] for line in r.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert vals[0] == pytest.approx(vals[1], abs=1e-6)

    teacher_bytes = 4 * sum(p.numel() for p in make_mlp().parameters())
    student_bytes = teacher_bytes  # the same shape
    for run, share in ((fsdp, 2), (single, 1)):
        memory = read_summary(run)["memory"]
        assert len(memory) == share
        for entry in memory:  # sharded like the model; no gradients or moments for it
            assert entry["frozen_bytes"] == teacher_bytes // share
            assert entry["params_bytes"] == student_bytes // share
            # AdamW: two moments per element held, one 4-byte step per parameter tensor
            assert entry["optimizer_bytes"] == 2 * student_bytes // share + 4 * 4
    assert "frozen" in r.stderr  # the verbose memory table shows the column
    # the snapshot holds the student and its optimizer state, nothing of the teacher
    snap = sorted((fsdp / "checkpoints").glob("step-*"))[-1]
    keys = list(FileSystemReader(str(snap)).read_metadata().state_dict_metadata)
    assert any("0.weight" in k for k in keys) and not any("teacher" in k for k in keys), keys
