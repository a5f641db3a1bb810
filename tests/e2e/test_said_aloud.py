"""What a run used to do without a word, said: trainer.eval_every=0 switches evaluation off (it
was refused, and no key said how); the start line says which of trainer.max_steps and
trainer.epochs decides the number of steps; blank lines of a .jsonl file are counted in the
log, not skipped silently; a train command says it lives before its slow imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env, cli_run, read_metrics, read_summary
from tests.e2e._tiny_model import make_pairs, write_jsonl

pytestmark = pytest.mark.timeout(240)


def _pairs_run(capsys, tmp_path, model, *overrides):
    """A few steps of fine-tuning the tiny local model on 12 pairs in this process."""
    if not (tmp_path / "pairs.jsonl").exists():
        write_jsonl(tmp_path / "pairs.jsonl", make_pairs(12))
    return cli_run(capsys, ["train", "model.arch=hf", f"model.path={model}", "data.format=pairs",
                            f"data.source={tmp_path / 'pairs.jsonl'}", "trainer.devices=cpu",
                            "trainer.batch_size=2", "trainer.progress_bar=false",
                            f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}",
                            *overrides])


def test_eval_every_zero_trains_without_evaluating(capsys, tmp_path, pairs_llama):
    r = _pairs_run(capsys, tmp_path, pairs_llama, "trainer.max_steps=4", "trainer.eval_every=0",
                   "trainer.log_every=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_summary(tmp_path / "run")["val_loss"] is None
    assert not any("val_loss" in m for m in read_metrics(tmp_path / "run"))
    assert "validation loss" not in r.stderr
    assert "4 steps by trainer.max_steps, trainer.epochs counts only when it is null (" \
        in r.stderr


def test_epochs_set_alone_decide_the_steps_and_the_start_line_says_so(capsys, tmp_path,
                                                                       pairs_llama):
    """trainer.epochs used to be ignored under trainer.max_steps' default (200) without a word."""
    r = _pairs_run(capsys, tmp_path, pairs_llama, "trainer.epochs=2", "trainer.eval_every=0")
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stderr.splitlines() if "per epoch)" in x][0]
    per_epoch = int(line.rsplit("(", 1)[1].split()[0])
    steps = read_summary(tmp_path / "run")["steps"]
    assert steps == 2 * per_epoch and f"; {steps} steps by trainer.epochs=2 (" in line, line


def test_blank_lines_of_a_records_file_are_counted(capsys, tmp_path, pairs_llama):
    rows = make_pairs(12)
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    lines = (tmp_path / "pairs.jsonl").read_text().splitlines()
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines[:5] + ["", "  "] + lines[5:]) + "\n")
    r = cli_run(capsys, ["train", "model.arch=hf", f"model.path={pairs_llama}",
                         "data.format=pairs", f"data.source={tmp_path / 'pairs.jsonl'}",
                         "trainer.devices=cpu", "trainer.max_steps=1", "trainer.batch_size=2",
                         "trainer.eval_every=0", "trainer.progress_bar=false",
                         f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 blank line(s) skipped (line 6, 7); 12 records read" in r.stderr, r.stderr[-3000:]


_BEFORE_TORCH = '''
import builtins, sys
from paratrain import cli

class TorchFirst:  # the import of torch ends the command: what printed before it is the answer
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise SystemExit("torch was imported before any line")

real = builtins.print
def spy(*args, **kwargs):
    real(*args, **kwargs)
    if args and "loading torch" in str(args[0]):
        raise SystemExit(0)
builtins.print = spy
sys.meta_path.insert(0, TorchFirst())
cli.main(["train", "configs/tiny.yaml"])
'''


def test_a_line_comes_before_the_slow_imports():
    """Under load the imports took two minutes without a word: the CLI says it lives first."""
    r = subprocess.run([sys.executable, "-c", _BEFORE_TORCH], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=cli_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip() == "[paratrain] config checked (tiny); loading torch"
