"""Seq2seq fine-tuning end to end and offline: a tiny T5 built here from a transformers config,
with a BPE tokenizer trained here, on input->output pairs (data.format=pairs: the encoder-decoder
model.path picks the task). The loss counts the target tokens only (the input's padding changes
nothing); LoRA on T5's q and v; the saved folders reload in plain transformers and peft with the
logits and the loss the run reported; `paratrain generate` prints the model's output. 1 worker,
2 workers and FSDP give the same losses: the task contract's seq2seq row
(tests/e2e/test_task_contract.py), whose FSDP run this file reads."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_run, read_metrics, read_summary, run_cli
from tests.e2e._preference_data import preference_rows, small_run_args, write_jsonl

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900)]


def pairs(n: int, seed: int) -> list[dict]:
    """{"input", "output"}: a prompt of random words -> the response that mentions the keyword."""
    return [{"input": r["prompt"], "output": r["chosen"].strip()}
            for r in preference_rows(n, seed)]


@pytest.fixture(scope="module")
def t5(tiny_t5) -> Path:
    return tiny_t5  # the session's (tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("seq2seq-data")
    return (write_jsonl(tmp / "train.jsonl", pairs(240, 0)),
            write_jsonl(tmp / "val.jsonl", pairs(21, 1)))


def s2s_args(model: Path, train: Path, val: Path, run_dir: Path, **extra) -> list[str]:
    return small_run_args(model, train, val, run_dir, **{"data.format": "pairs", **extra})


def _task(t5: Path, train: Path, val: Path):
    from paratrain.config import TrainConfig
    from paratrain.dist import DistEnv
    from paratrain.runtime.rank import prepare_task
    cfg = TrainConfig.from_yaml(None, s2s_args(t5, train, val, Path("unused"))[1:])
    return prepare_task(cfg, DistEnv.single("cpu"), quiet=True)


def test_the_loss_counts_target_tokens_and_ignores_input_padding(t5, data):
    from paratrain.tasks.seq2seq import Seq2SeqTask
    task = _task(t5, *data)
    assert isinstance(task, Seq2SeqTask)
    model = task.build_model().eval()
    batch = task.collate([task.train_ds[i] for i in range(4)])
    targets = [task.train_ds[i]["targets"] for i in range(4)]
    n_targets = sum(len(t) for t in targets)
    assert task.count_units(batch) == n_targets
    amp, cpu = contextlib.nullcontext(), torch.device("cpu")
    with torch.no_grad():
        s, n = task.loss(model, batch, cpu, amp)
        wider = dict(batch)  # 7 more pads after every input, masked out of attention
        pad = torch.full((4, 7), task.tokenizer.pad_token_id)
        wider["input_ids"] = torch.cat([batch["input_ids"], pad], dim=1)
        wider["attention_mask"] = torch.cat([batch["attention_mask"], torch.zeros_like(pad)], 1)
        s_wide, n_wide = task.loss(model, wider, cpu, amp)
        other = dict(batch, input_ids=batch["input_ids"].flip(0))  # other inputs, same targets
        s_other, _ = task.loss(model, other, cpu, amp)
    assert n == n_wide == n_targets
    assert float(s_wide) == pytest.approx(float(s), abs=1e-5)
    assert abs(float(s_other) - float(s)) > 1e-3  # the input does matter
    # every target ends with EOS; inputs carry what the tokenizer gives them
    assert all(int(t[-1]) == task.tokenizer.eos_token_id for t in targets)


def _loss_with_transformers(model, task, rows: list[dict]) -> float:
    """The mean target-token loss of `model` (plain transformers) on rows, one at a time."""
    tok, total, count = task.tokenizer, 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = tok(row["input"], return_tensors="pt")
            labels = torch.tensor([tok(row["output"])["input_ids"] + [tok.eos_token_id]])
            out = model(**ids, labels=labels)
            total += float(out.loss) * labels.numel()
            count += labels.numel()
    return total / count


@pytest.mark.slow
def test_saved_folder_reloads_with_the_runs_loss_and_generates(tmp_path_factory, contract_inputs,
                                                               t5, capsys):
    """On the task contract's seq2seq runs (1 worker accumulating and 2 FSDP workers, every T5
    block of both stacks sharded, agree; a killed run resumes bit-identical): the FSDP run's
    model/ reloads in transformers with the loss the run reported, and generates greedily."""
    import transformers

    from tests.e2e.test_task_contract import runs_of, settings_of
    key = ("pairs", "seq2seq")
    _, two = runs_of(tmp_path_factory, key, contract_inputs)
    assert "seq2seq model hf" in two.stderr and read_summary(two.dir)["strategy"] == "fsdp"
    run_dir, own = two.dir, settings_of(key, contract_inputs)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(run_dir / "model",
                                                               local_files_only=True).eval()
    train, val = Path(own["data.source"]), Path(own["data.val_source"])
    task = _task(t5, train, val)
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    assert _loss_with_transformers(model, task, rows) == pytest.approx(
        read_summary(run_dir)["val_loss"], abs=1e-5)
    assert (run_dir / "model" / "tokenizer.json").read_bytes() == \
        (t5 / "tokenizer.json").read_bytes()
    g = cli_run(capsys, ["generate", str(run_dir), "--prompt", rows[0]["input"], "--temperature",
                         "0", "--max-new-tokens", "6"])
    assert g.returncode == 0, g.stderr[-2000:]
    ids = task.tokenizer(rows[0]["input"], return_tensors="pt")
    greedy = model.generate(**ids, max_new_tokens=6, do_sample=False)
    assert g.stdout.strip() == task.tokenizer.decode(greedy[0], skip_special_tokens=True).strip()


@pytest.mark.slow
def test_lora_on_q_and_v_trains_adapters_that_reload(tmp_path, t5, data):
    peft = pytest.importorskip("peft")
    import transformers
    from safetensors.torch import load_file
    run_dir = tmp_path / "lora"
    r = run_cli(s2s_args(t5, *data, run_dir, **{
        "model.lora.r": 4, "model.lora.target_modules": "[q,v]", "trainer.strategy": "fsdp",
        "optim.lr": 1e-2}), cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(run_dir)]
    assert losses[-1] < losses[0]
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".q." in k or ".v." in k for k in adapter), list(adapter)[:4]
    base = load_file(str(t5 / "model.safetensors"))
    merged = load_file(str(run_dir / "model" / "model.safetensors"))
    untouched = [k for k in base if not k.endswith((".q.weight", ".v.weight"))]
    assert all(torch.equal(base[k], merged[k]) for k in untouched if k in merged)
    assert any(not torch.equal(base[k], merged[k]) for k in base if k.endswith(".q.weight"))
    # the merged folder and base + adapter give the same logits, and the run's loss
    task = _task(t5, *data)
    batch = task.collate([task.val_ds[i] for i in range(4)])
    fresh = transformers.AutoModelForSeq2SeqLM.from_pretrained(t5, local_files_only=True)
    models = [transformers.AutoModelForSeq2SeqLM.from_pretrained(run_dir / "model",
                                                                 local_files_only=True),
              peft.PeftModel.from_pretrained(fresh, run_dir / "adapter")]
    with torch.no_grad():
        logits = [m.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           labels=batch["targets"]).logits for m in models]
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
    rows = [json.loads(line) for line in data[1].read_text().splitlines()]
    assert _loss_with_transformers(models[0], task, rows) == pytest.approx(
        read_summary(run_dir)["val_loss"], abs=1e-5)
