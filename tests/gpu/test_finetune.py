"""Fine-tuning a local Hugging Face Llama (random weights from a config, a tokenizer trained
offline) on GPU 0 in bf16: LoRA on input->output pairs, and DPO on preference pairs."""

from __future__ import annotations

import json

import pytest

from tests.conftest import read_metrics, read_summary, run_cli
from tests.e2e._preference_data import (
    make_preference_llama,
    small_run_args,
    write_preference_data,
)

pytestmark = pytest.mark.timeout(400)
pytest.importorskip("transformers")

ON_GPU = {"trainer.devices": "cuda:0", "trainer.precision": "bf16-mixed",
          "trainer.max_steps": 16, "trainer.batch_size": 8}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_preference_llama(tmp_path_factory.mktemp("gpu-llama"))


@pytest.fixture(scope="module")
def preference(tmp_path_factory):
    return write_preference_data(tmp_path_factory.mktemp("gpu-pref"))


def test_lora_finetune_in_bf16(tmp_path, llama):
    pytest.importorskip("peft")
    from paratrain.data.stdlib_pairs import stdlib_pairs
    rows = stdlib_pairs(200)
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:160]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[160:]))
    r = run_cli(small_run_args(llama, train, val, tmp_path / "run", **{
        **ON_GPU, "data.format": "pairs", "model.lora.r": 4, "optim.lr": 1e-2}),
        cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    losses = [m["loss"] for m in read_metrics(run)]
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.05, losses  # the adapters learn
    s = read_summary(run)
    assert s["precision"] == "bf16-mixed" and s["memory"][0]["device"] == "cuda:0", s
    assert (run / "adapter").is_dir() and (run / "model" / "model.safetensors").is_file()


def test_dpo_in_bf16(tmp_path, llama, preference):
    r = run_cli(small_run_args(llama, *preference, tmp_path / "run", **{
        **ON_GPU, "data.format": "preference"}), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["loss"] == pytest.approx(0.6931, abs=0.01)  # log 2: policy == reference
    assert rows[-1]["loss"] < rows[0]["loss"]
    margins = [m["rewards/margin"] for m in rows[-4:]]
    assert sum(margins) > 0, margins  # it comes to prefer the chosen responses
    assert read_summary(tmp_path / "run")["memory"][0]["device"] == "cuda:0"


def test_qlora_nf4_on_the_gpu(tmp_path, llama):
    """model.quantize=nf4 with LoRA on GPU 0 (bitsandbytes' CUDA kernels): the loss falls and
    model/ (merged onto the full-precision base) loads in plain transformers."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    import transformers

    from paratrain.data.stdlib_pairs import stdlib_pairs
    rows = stdlib_pairs(200)
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:160]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[160:]))
    r = run_cli(small_run_args(llama, train, val, tmp_path / "run", **{
        **ON_GPU, "data.format": "pairs", "model.lora.r": 8, "model.quantize": "nf4",
        "optim.lr": 3e-2}), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.3, losses
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert getattr(model.config, "quantization_config", None) is None
