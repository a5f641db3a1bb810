"""The start-up of a real 2-worker command (issue 21): a second fine-tune on the same records reuses
the encoded records the first one saved and trains exactly the same steps; summary.json says
where the start-up went; each worker runs in a session of its own and never outlives its
launcher."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import read_metrics, read_summary, run_cli, tiny_overrides
from tests.distributed._snapshot_helpers import finish, start_cli, steps_logged, wait_for, \
    worker_pids

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny Llama with random weights (nothing trained) and a BPE tokenizer, saved as a
    Hugging Face folder, and 200 stdlib signature -> docstring pairs beside it."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    from paratrain.data.stdlib_pairs import stdlib_pairs
    from tests.conftest import make_hf_tokenizer
    out = tmp_path_factory.mktemp("tiny-hf")
    rows = stdlib_pairs(200)
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_hf_tokenizer(out / "model", [r["input"] + " " + r["output"] for r in rows],
                      vocab_size=400)
    tok = transformers.AutoTokenizer.from_pretrained(out / "model")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(out / "model")
    return out


@pytest.mark.slow
def test_a_second_run_reuses_the_encoded_records_and_trains_the_same(tiny_hf, tmp_path):
    def run(name: str):
        r = run_cli(["train", "model.arch=hf", f"model.path={tiny_hf / 'model'}",
                     "data.format=pairs", f"data.source={tiny_hf / 'train.jsonl'}",
                     "data.max_length=48", f"data.cache_dir={tmp_path / 'cache'}",
                     "trainer.devices=cpu:2", "trainer.batch_size=4", "trainer.max_steps=6",
                     "trainer.log_every=1", "trainer.progress_bar=false",
                     "distributed.timeout_s=60", f"run.dir={tmp_path / name}"], cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stderr, read_metrics(tmp_path / name), read_summary(tmp_path / name)

    first_log, first, first_summary = run("first")
    second_log, second, second_summary = run("second")
    cache = tmp_path / "cache" / "encoded" / first_summary["data_fingerprint"]
    assert f"data: encoded records saved in {cache}" in first_log
    assert f"data: reusing the encoded records in {cache}" in second_log
    for log in (first_log, second_log):  # what encoding did, said once in each
        assert log.count("train.jsonl: 200 rows ->") == 1, log
    assert [m["loss"] for m in second] == [m["loss"] for m in first]  # bitwise
    assert len(first) == 6 and second_summary["val_loss"] == first_summary["val_loss"]
    phases = second_summary["startup_s"]
    assert list(phases) == ["launcher_imports", "launcher_data", "spawn", "imports", "init",
                            "data", "model", "records", "first_step", "total"]
    assert sum(v for k, v in phases.items() if k != "total") == \
        pytest.approx(phases["total"], abs=0.01)


def test_each_worker_has_its_own_session_and_dies_with_the_launcher(tmp_path, corpus_dir,
                                                                    cache_dir):
    args = ["train"] + tiny_overrides(corpus_dir, cache_dir, **{
        "trainer.devices": "cpu:2", "trainer.max_steps": 100000, "run.dir": tmp_path / "run"})
    proc = start_cli(args, cwd=tmp_path)
    wait_for(lambda: steps_logged(tmp_path / "run") >= 1, proc, timeout=300,
             what="the first logged step")
    workers = worker_pids(proc.pid)
    assert len(workers) == 2
    assert {os.getsid(w) for w in workers} == set(workers)  # each leads a session of its own
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer would
    finish(proc, timeout=60)  # its pipes close once the workers (which share them) are gone
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its exit status is left
