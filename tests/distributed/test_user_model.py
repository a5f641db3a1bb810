"""Bring your own model and data: a non-language model under DDP and FSDP with 2 workers, its
own collate and loss; a tiny Hugging Face Llama from a local config; the examples at tiny size."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, cli_error, read_metrics, read_summary, run_cli, tiny_overrides

pytestmark = pytest.mark.timeout(300)

CNN_SCRIPT = """
import json, sys
sys.path.insert(0, {examples!r})
from custom_model import Stripes, ConvBlock, make_model, classification_loss
from paratrain import Trainer

def collate(items):  # the user's own collate: a (images, labels) tuple
    import torch
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

if __name__ == "__main__":
    strategy = sys.argv[1]
    r = Trainer(model=make_model, train_data=Stripes(512), val_data=Stripes(64, seed=1),
                loss_fn=classification_loss, collate_fn=collate, fsdp_wrap=[ConvBlock],
                devices="cpu:2", strategy=strategy, max_steps=30, batch_size=8, log_every=5,
                eval_every=1000, lr=3e-3, run_dir="runs/" + strategy, progress_bar=False).fit()
    sys.stdout.write("RESULT " + json.dumps({{"val": r.val_loss, "loss": r.final_loss}}) + "\\n")
"""


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_user_cnn_trains_and_comes_back(tmp_path, capsys, strategy):
    script = tmp_path / "cnn.py"
    script.write_text(CNN_SCRIPT.format(examples=str(REPO / "examples")))
    r = run_cli([str(script), strategy], cwd=tmp_path, timeout=240, launcher=[sys.executable])
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs" / strategy
    rows = read_metrics(run_dir)
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]  # it learns the stripes
    s = read_summary(run_dir)
    assert s["strategy"] == strategy and s["world_size"] == 2
    # the model comes back from disk into a fresh model of the user's factory
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from custom_model import Stripes, make_model
    finally:
        sys.path.remove(str(REPO / "examples"))
    from paratrain import load_model
    model, tokenizer = load_model(run_dir, model=make_model)
    assert tokenizer is None and not model.training
    saved = load_file(str(run_dir / "model" / "model.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    if strategy == "ddp":  # the CLI cannot rebuild it: one line that says how to load it
        line = cli_error(capsys, ["generate", str(run_dir)], only_line=True)  # (in this process)
        assert "load_model(" in line and "model=make_model)" in line, line
    ds = Stripes(64, seed=1)
    x = torch.stack([ds[i][0] for i in range(64)])
    y = torch.stack([ds[i][1] for i in range(64)])
    with torch.no_grad():
        val = torch.nn.functional.cross_entropy(model(x), y).item()
    assert abs(val - s["val_loss"]) < 1e-4


def test_unpicklable_factory_is_a_clear_error(tmp_path, monkeypatch):
    """Checked in fit() before any process starts: here, in this process (a lambda is as
    unpicklable in a test module as in a user's script)."""
    from paratrain import Trainer
    from paratrain.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="model= cannot be sent to the worker processes") as e:
        Trainer(model=lambda: torch.nn.Linear(2, 2), train_data=[torch.zeros(2)] * 8,
                devices="cpu:2").fit()
    assert "module level" in str(e.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_hf_llama_from_local_config(tmp_path, corpus_dir, cache_dir):
    transformers = pytest.importorskip("transformers", reason="the optional extra [hf] is not "
                                       "installed")
    cfg_dir = tmp_path / "tiny-llama"
    transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(cfg_dir)
    over = tiny_overrides(corpus_dir, cache_dir, **{
        "run.name": "hf", "model.arch": "hf", "model.path": str(cfg_dir), "data.tokenizer": "bpe",
        "trainer.devices": "cpu:2", "trainer.strategy": "fsdp", "trainer.max_steps": 10})
    r = run_cli(["train"] + over, cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "hf"
    rows = read_metrics(run_dir)
    assert rows[-1]["loss"] < rows[0]["loss"]
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "model",
                                                              local_files_only=True)
    assert (run_dir / "model" / "tokenizer.json").is_file()
    batch = torch.randint(0, 384, (1, 16))
    assert model(batch).logits.shape == (1, 16, 384)
    assert read_summary(run_dir)["params"] == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_custom_model_example_runs(tmp_path):
    r = run_cli([str(REPO / "examples" / "custom_model.py"), "--devices", "cpu:2", "--steps",
                 "10", "--run-dir", str(tmp_path / "run")], cwd=tmp_path, timeout=240,
                launcher=[sys.executable])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "final loss" in r.stdout
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
