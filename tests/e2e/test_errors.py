"""Every user error the core promises to catch: one line naming what is wrong, exit code 2, no
traceback, nothing written or overwritten."""

from __future__ import annotations

import pytest

from tests.conftest import cli_error, run_cli, tiny_overrides

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("overrides, words", [
    (["trainer.no_such_key=1"], ["unknown config key 'trainer.no_such_key'"]),
    (["trainer.max_steps=ten"], ["trainer.max_steps='ten' is not a whole number"]),
    (["trainer.epochs=null"], ["trainer.epochs cannot be null",
                               "trainer.max_steps=null trainer.epochs=N", "trainer.max_steps=N"]),
    (["data.padded_overflow=wrap"], ["data.padded_overflow='wrap'", "truncate, split"]),
    (["trainer.devices=cpu:0"], ["trainer.devices='cpu:0'", "cpu:1 or more"]),
    (["trainer.devices=[7]"], ["GPU 7 does not exist"]),
    (["trainer.strategy=foo"], ["trainer.strategy='foo'", "ddp"]),
    (["model.num_heads=5"], ["model.num_heads=5 does not divide model.hidden_size"]),
    (["model.preset=tiny", "model.num_kv_heads=3"],
     ["model.num_kv_heads=3 does not divide model.num_heads"]),
    (["trainer.devices=cpu:2", "trainer.strategy=single"], ["trainer.strategy=single"]),
    (["trainer.devices=cpu:2", "trainer.strategy=dp"], ["trainer.strategy=dp", "CUDA"]),
    (["trainer.devices=cpu:2", "trainer.strategy=ddp", "trainer.cpu_offload=true"],
     ["trainer.cpu_offload=true needs trainer.strategy=fsdp"]),
    (["trainer.devices=cpu:2", "trainer.batch_size=4", "trainer.global_batch_size=10"],
     ["trainer.global_batch_size=10 is not divisible", "4 x 2 = 8"]),
])
def test_config_errors(tmp_path, monkeypatch, capsys, corpus_dir, cache_dir, overrides, words):
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, ["train"] + tiny_overrides(corpus_dir, cache_dir) + overrides)
    for w in words:
        assert w in line
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_missing_and_empty_sources(tmp_path, monkeypatch, capsys, cache_dir):
    monkeypatch.chdir(tmp_path)
    base = ["train", "model.preset=tiny", f"data.cache_dir={cache_dir}", "trainer.devices=cpu:2"]
    line = cli_error(capsys, base + [f"data.source={tmp_path}/nope"])
    assert "data.source=" in line and "does not exist" in line
    (tmp_path / "empty").mkdir()
    line = cli_error(capsys, base + [f"data.source={tmp_path}/empty"])
    assert "data.source=" in line
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    line = cli_error(capsys, base + [f"data.source={tmp_path}/blank"])
    assert "holds no text" in line


def test_corpus_too_small_for_one_batch(tmp_path, monkeypatch, capsys, cache_dir):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    line = cli_error(capsys, ["train", "model.preset=tiny", f"data.cache_dir={cache_dir}",
                          f"data.source={tmp_path}/small.txt", "data.vocab_size=300",
                          "trainer.devices=cpu:2", "data.seq_length=256"])
    assert "fewer than one global batch" in line and "data.seq_length" in line
    assert not (tmp_path / "runs").exists()


def test_run_dir_holding_a_run_is_not_overwritten(tmp_path, monkeypatch, capsys, corpus_dir,
                                                   cache_dir):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "taken"
    run.mkdir(parents=True)
    (run / "summary.json").write_text('{"final_loss": 1.0}')
    line = cli_error(capsys, ["train", "run.name=taken"] + tiny_overrides(corpus_dir, cache_dir))
    # the three ways on: a new run, replacing it, or (an unfinished run) continuing it
    for words in ("already holds a finished run", "another run.name", "run_name=",
                  "run.overwrite=true", "overwrite=True", "checkpoint.every_steps=N"):
        assert words in line, line
    assert (run / "summary.json").read_text() == '{"final_loss": 1.0}'
    assert sorted(p.name for p in run.iterdir()) == ["summary.json"]


def test_generate_without_a_model(tmp_path, capsys):
    line = cli_error(capsys, ["generate", str(tmp_path)])
    assert "holds no trained model" in line


def test_exit_code_from_the_real_process(tmp_path):
    """The same as above, through the console entry point of a separate process."""
    r = run_cli(["train", "trainer.strategy=foo"], cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "paratrain: error: trainer.strategy='foo' is not one of: auto, single, ddp, fsdp, hsdp, "
        "dp"]


def test_help_exits_zero_from_the_real_process(tmp_path):
    """argparse's --help leaves through SystemExit(0): the entry point's fast exit keeps the 0
    (a script checking `paratrain --help` must not see a failure)."""
    r = run_cli(["--help"], cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and "usage: paratrain" in r.stdout, r.stderr[-2000:]
