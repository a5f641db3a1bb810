"""Text classification end to end and offline (data.format=classify): a tiny Llama built here from a
transformers config, with a BPE tokenizer trained here, learns whether a sentence mentions a
keyword. Real worker processes: the accuracy reported with the validation loss rises, counts every
validation text once (an odd number of them), and equals the accuracy recomputed from the saved
model with transformers. 1 and 2 workers give the same run (losses, accuracy, every validation
text once): the task contract's classify row (tests/e2e/test_task_contract.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    QUIET_RECORDS,
    cli_run,
    make_hf_llama,
    read_metrics,
    read_summary,
    run_cli,
)

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600)]

WORDS = ("the a red blue green small big cat dog bird runs sits sees eats near under over "
         "house tree river stone quick slow old new").split()
KEYWORD = "apple"
N_VAL = 51  # odd: split over 2 workers and batches of 4, every text must still count once


def sentences(n: int, seed: int) -> list[dict]:
    """{"text", "label"} rows: label "yes" when the sentence mentions KEYWORD (half of them)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]
        if i % 2:
            words.insert(rng.randrange(len(words) + 1), KEYWORD)
        rows.append({"text": " ".join(words), "label": "yes" if i % 2 else "no"})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("classify-data")
    for name, rows in (("train.jsonl", sentences(1024, 0)), ("val.jsonl", sentences(N_VAL, 1))):
        (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp / "train.jsonl", tmp / "val.jsonl"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """A tiny 'pretrained' causal Llama (random weights, saved with save_pretrained) and a
    byte-level BPE tokenizer trained on the sentences, without a pad token."""
    return make_hf_llama(tmp_path_factory.mktemp("classify-model"),
                         [r["text"] for r in sentences(256, 0)], vocab_size=300, bos=False)


def _args(model: Path, train: Path, val: Path, run_dir: Path, **extra) -> list[str]:
    base = {"model.arch": "hf", "model.path": str(model), "data.format": "classify",
            "data.source": str(train), "data.val_source": str(val), "data.max_length": 32,
            "trainer.devices": "cpu:2", "trainer.batch_size": 4,
            "trainer.global_batch_size": 16, "trainer.max_steps": 10, "trainer.log_every": 1,
            "trainer.eval_every": 1000, "trainer.progress_bar": "false", "optim.lr": 3e-3,
            "optim.warmup_steps": 3, "optim.min_lr": 3e-4, "distributed.timeout_s": 60,
            **QUIET_RECORDS, "run.dir": str(run_dir)}
    base.update(extra)
    return ["train"] + [f"{k}={v}" for k, v in base.items()]


def accuracy_with_transformers(model_dir: Path, rows: list[dict]) -> float:
    """Accuracy of the saved classifier, one text at a time, labels by the saved id2label."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, local_files_only=True).eval()
    right = 0
    with torch.no_grad():
        for row in rows:
            k = int(model(**tok(row["text"], return_tensors="pt")).logits.argmax(-1))
            right += model.config.id2label[k] == row["label"]
    return right / len(rows)


@pytest.mark.slow
def test_accuracy_rises_and_matches_the_saved_model(tmp_path, base_model, data, capsys):
    train, val = data
    run_dir = tmp_path / "run"
    r = run_cli(_args(base_model, train, val, run_dir, **{
        "trainer.max_steps": 60, "trainer.eval_every": 20, "trainer.log_every": 10}),
        cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [m for m in read_metrics(run_dir) if "val_accuracy" in m]
    assert [m["step"] for m in evals] == [20, 40]
    assert all(m["val_samples"] == N_VAL for m in evals)
    s = read_summary(run_dir)
    assert s["val_samples"] == N_VAL
    assert s["val_accuracy"] >= 0.9 and s["val_accuracy"] > evals[0]["val_accuracy"], evals
    assert f"accuracy {s['val_accuracy']:.4f} on {N_VAL} texts" in r.stderr
    assert f"accuracy {s['val_accuracy']:.4f}" in r.stdout
    config = json.loads((run_dir / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "no", "1": "yes"}
    assert config["label2id"] == {"no": 0, "yes": 1}
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    assert accuracy_with_transformers(run_dir / "model", rows) == pytest.approx(
        s["val_accuracy"], abs=1e-9)
    assert (run_dir / "model" / "tokenizer.json").read_bytes() == \
        (base_model / "tokenizer.json").read_bytes()
    g = cli_run(capsys, ["generate", str(run_dir), "--prompt", f"the red {KEYWORD} near the house"])
    assert g.returncode == 0, g.stderr[-2000:]
    assert g.stdout.strip() == "yes" and "text classifier" in g.stderr


def test_python_api_classifies_lists(tmp_path, base_model, monkeypatch):
    """Trainer(model=DIR, train_input=texts, train_output=labels, task="classify"), one process;
    integer labels are class ids."""
    from paratrain import Trainer
    monkeypatch.chdir(tmp_path)
    rows = sentences(40, 2)
    texts, labels = [r["text"] for r in rows], [int(r["label"] == "yes") for r in rows]
    result = Trainer(model=str(base_model), train_input=texts, train_output=labels,
                     validation_input=texts[:7], validation_output=labels[:7], task="classify",
                     devices="cpu", max_steps=3, batch_size=8, log_every=1, lr=3e-3,
                     progress_bar=False, run_dir=str(tmp_path / "api")).fit()
    assert result.steps == 3 and result.summary["val_samples"] == 7
    assert 0.0 <= result.summary["val_accuracy"] <= 1.0
    config = json.loads((tmp_path / "api" / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "0", "1": "1"}


def test_lora_classifier_trains_the_new_head_and_saves_both(tmp_path, base_model, data, capsys):
    """LoRA on a classifier: adapters plus the new head (peft's modules_to_save); model/ is the
    merged classifier, and its accuracy is the one the run reported. Its step-2 snapshot
    exports (`paratrain checkpoint export`) as a classifier too: merged, with the run's labels,
    and as the adapter alone, which peft puts on the base with the same predictions. One
    device: the CLI trains in its own process, here this one (cli.main, as `cli_run` does)."""
    peft = pytest.importorskip("peft")
    import transformers

    from paratrain import cli
    train, val = data
    run_dir = tmp_path / "lora"
    r = cli_run(capsys, _args(base_model, train, val, run_dir, **{
        "trainer.devices": "cpu", "trainer.batch_size": 16, "model.lora.r": 4,
        "trainer.max_steps": 4, "checkpoint.every_steps": 2}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    s = read_summary(run_dir)
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    assert accuracy_with_transformers(run_dir / "model", rows) == pytest.approx(
        s["val_accuracy"], abs=1e-9)
    # the step-2 snapshot, exported
    snapshot = str(run_dir / "checkpoints" / "step-0000002")
    assert cli.main(["checkpoint", "export", snapshot, str(tmp_path / "merged"), "--merge"]) == 0
    assert cli.main(["checkpoint", "export", snapshot, str(tmp_path / "adapter")]) == 0
    labels = lambda d: json.loads((d / "config.json").read_text())["id2label"]  # noqa: E731
    assert labels(tmp_path / "merged") == labels(run_dir / "model") == {"0": "no", "1": "yes"}
    assert 0.0 <= accuracy_with_transformers(tmp_path / "merged", rows) <= 1.0
    auto = transformers.AutoModelForSequenceClassification
    ids = torch.tensor([[5, 9, 17, 33, 60]])  # (1, 5)
    with torch.no_grad():
        exported = auto.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
        merged = exported(ids)
        base = auto.from_pretrained(base_model, local_files_only=True, num_labels=2,
                                    pad_token_id=exported.config.pad_token_id).eval()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids)
        final = auto.from_pretrained(run_dir / "model", local_files_only=True).eval()(ids)
    assert (merged.logits - adapted.logits).abs().max() < 1e-5
    assert not torch.allclose(merged.logits, final.logits)  # step 2's weights, not step 4's
