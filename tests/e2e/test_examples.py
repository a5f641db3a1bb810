"""The examples run as a user runs them, at tiny size."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO, read_summary, run_cli, tiny_overrides

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_llama_pretrain_example(tmp_path, corpus_dir, cache_dir):
    over = tiny_overrides(corpus_dir, cache_dir, **{"trainer.devices": "cpu:2",
                                                     "run.dir": str(tmp_path / "run")})
    r = run_cli([str(REPO / "examples" / "llama_pretrain.py")] + over, cwd=tmp_path,
                timeout=240, launcher=[sys.executable])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "final loss" in r.stdout
    lines = r.stdout.strip().splitlines()
    assert lines[1].startswith("def ")  # the generation after the loss line
    assert read_summary(tmp_path / "run")["world_size"] == 2


def test_mingpt_char_example(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(("to be, or not to be, that is the question:\n" * 200))
    r = run_cli([str(REPO / "examples" / "mingpt_char.py"), "--text", str(text), "--steps", "10",
                 "--devices", "cpu:2", "--run-dir", str(tmp_path / "run"), "--prompt", "to be"],
                cwd=tmp_path,
                timeout=240, launcher=[sys.executable], env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    s = read_summary(tmp_path / "run")
    assert s["world_size"] == 2 and s["steps"] == 10
    out = r.stdout.splitlines()
    assert out[0].startswith("final loss") and out[1].startswith("to be")
    # a char vocabulary: every character of the output occurs in the text
    assert set("\n".join(out[1:])) <= set(text.read_text())
