"""Fine-tuning a pretrained model, end to end and offline: pretrain a tiny Llama with paratrain,
export it to Hugging Face format, fine-tune the export on input->output pairs from the standard
library (a function's signature -> the first line of its docstring) with 2 CPU workers, then load
and generate. Plus: the loss counts only output tokens, the Python API, and bad input (one line,
exit 2). 1 and 2 workers give the same run: the task contract's pairs row
(tests/e2e/test_task_contract.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from tests._runs import Run, tiny_run, trained_run
from tests.conftest import (
    QUIET_RECORDS,
    REPO,
    cli_error,
    cli_run,
    finish,
    read_metrics,
    read_summary,
    run_cli,
    start_cli,
)

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus_dir, cache_dir) -> Path:
    """A tiny Llama pretrained here (40 steps, the session's run), exported as a
    LlamaForCausalLM folder (what `paratrain checkpoint export --format hf` writes; that command
    itself is run in test_pretrained_tokenizer.py)."""
    from paratrain.checkpoint.hf_export import export_hf
    run = tiny_run(tmp_path_factory, corpus_dir, cache_dir, **{
        "data.seq_length": 64, "trainer.max_steps": 40, "trainer.devices": "cpu:2",
        "trainer.log_every": 10})
    return export_hf(run.dir, tmp_path_factory.mktemp("pretrained") / "hf")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> tuple[Path, Path]:
    from paratrain.data.stdlib_pairs import stdlib_pairs
    tmp = tmp_path_factory.mktemp("pairs")
    rows = stdlib_pairs(400)
    for name, part in (("train.jsonl", rows[:320]), ("val.jsonl", rows[320:])):
        (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return tmp / "train.jsonl", tmp / "val.jsonl"


def _settings(model: Path, train: Path, val: Path, **extra) -> dict:
    """Fine-tuning `model` on the pairs with 2 workers (the overrides, without run.dir)."""
    return {"model.arch": "hf", "model.path": str(model), "data.format": "pairs",
            "data.source": str(train), "data.val_source": str(val), "data.max_length": 64,
            "trainer.devices": "cpu:2", "trainer.batch_size": 4,
            "trainer.global_batch_size": 16, "trainer.max_steps": 40, "trainer.log_every": 10,
            "trainer.eval_every": 1000, "trainer.progress_bar": "false", "optim.lr": 3e-3,
            "optim.warmup_steps": 5, "distributed.timeout_s": 60, **QUIET_RECORDS, **extra}


def _finetune_args(model: Path, train: Path, val: Path, run_dir: Path, **extra) -> list[str]:
    over = {**_settings(model, train, val, **extra), "run.dir": str(run_dir)}
    return ["train"] + [f"{k}={v}" for k, v in over.items()]


def _finetuned(tmp_path_factory, model: Path, train: Path, val: Path, **extra) -> Run:
    """The session's fine-tuning run of these settings (read only)."""
    return trained_run(tmp_path_factory, _settings(model, train, val, **extra))


# LoRA on 2 workers, a snapshot every 4 steps: the LoRA tests' run and the killed run's reference
LORA = {"model.lora.r": 4, "trainer.max_steps": 16, "trainer.log_every": 1,
        "checkpoint.every_steps": 4, "checkpoint.record_samples": "true", "optim.lr": 1e-2}
# full fine-tuning under FSDP2, a snapshot every 4 steps: the LoRA test's full-model memory
# reference and the exported full fine-tune
FULL_FSDP = {"trainer.strategy": "fsdp", "trainer.max_steps": 16, "checkpoint.every_steps": 4}


def _val_loss_on_outputs(model_dir: Path, val: Path, model=None) -> float:
    """The model's mean loss over the output tokens of the validation pairs, measured here with
    transformers (the same encoding and masking as training). `model`: one already loaded."""
    import contextlib

    import transformers

    from paratrain.data.examples import PadCollate
    from paratrain.data.finetune import encode_pairs
    from paratrain.data.hf_tokenizer import load_tokenizer
    from paratrain.data.rows import read_rows
    from paratrain.tasks.base import token_loss
    tok, _ = load_tokenizer(model_dir)
    examples, _ = encode_pairs(read_rows(str(val), what="val"), tok, max_length=64,
                               chat_template="auto")
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                                  local_files_only=True)
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            s, n = token_loss(model, PadCollate(tok.pad_token_id)(examples[i:i + 16]),
                              torch.device("cpu"), contextlib.nullcontext())
            total, count = total + float(s), count + n
    return total / count


def test_pretrain_export_finetune_generate(tmp_path, tmp_path_factory, pretrained, pairs,
                                           capsys):
    train, val = pairs
    before = _val_loss_on_outputs(pretrained, val)
    r = _finetuned(tmp_path_factory, pretrained, train, val)  # the LoRA test's full run too
    run_dir = r.dir
    assert r.stderr.count("train.jsonl: 320 rows ->") == 1  # what encoding did, said once
    s = read_summary(run_dir)
    after = _val_loss_on_outputs(run_dir / "model", val)
    assert after < 0.85 * before, (before, after)
    assert s["val_loss"] == pytest.approx(after, rel=1e-4)  # the run measured the same thing
    # the model's own tokenizer, carried unchanged
    assert (run_dir / "model" / "tokenizer.json").read_bytes() == \
        (pretrained / "tokenizer.json").read_bytes()
    g = cli_run(capsys, ["generate", str(run_dir), "--prompt", "def read(self, size):",
                         "--max-new-tokens", "8"])
    assert g.returncode == 0, g.stderr[-2000:]
    assert g.stdout.startswith("def read(self, size):")


def test_python_api_fine_tunes_on_lists(tmp_path, pretrained, monkeypatch):
    from paratrain import Trainer
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    inputs = [f"def f{i}(x):" for i in range(48)]
    outputs = [f"Return x plus {i}." for i in range(48)]
    result = Trainer(model=str(pretrained), train_input=inputs, train_output=outputs,
                     validation_input=inputs[:8], validation_output=outputs[:8],
                     devices="cpu:2", max_steps=6, batch_size=4, log_every=2, lr=3e-3,
                     progress_bar=False, run_dir=str(tmp_path / "api")).fit()
    assert result.val_loss is not None and result.steps == 6
    assert (tmp_path / "api" / "model" / "model.safetensors").is_file()
    assert read_summary(tmp_path / "api")["world_size"] == 2


def test_bad_fine_tuning_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, hf_llama,
                                                       pairs):
    """One real process (the data is refused in the launching process: exit 2, nothing
    written); the other refusals in this process, through the same cli.main."""
    train, val = pairs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "output": "b"}\n{"input": "c", "output": "d"}\n'
                   '{"input": "e", "answer": "f"}\n')
    r = run_cli(_finetune_args(hf_llama, bad, val, tmp_path / "r1"), cwd=tmp_path)
    assert r.returncode == 2
    assert "bad.jsonl" in r.stderr and "row 3" in r.stderr and "output" in r.stderr
    assert "Traceback" not in r.stderr
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, _finetune_args(hf_llama, train, val, tmp_path / "r2",
                                            **{"model.arch": "llama"}))
    assert "model.arch=hf" in line
    encdec = tmp_path / "t5"
    encdec.mkdir()
    (encdec / "config.json").write_text(json.dumps({"model_type": "t5",
                                                    "is_encoder_decoder": True}))
    # (pairs train an encoder-decoder model: tasks/seq2seq.py; chat data does not)
    assert "encoder-decoder" in cli_error(capsys, _finetune_args(
        encdec, train, val, tmp_path / "r3", **{"data.format": "chat"}))
    notok = tmp_path / "no-tokenizer"
    notok.mkdir()
    (notok / "config.json").write_text((hf_llama / "config.json").read_text())
    assert "data.tokenizer" in cli_error(capsys, _finetune_args(notok, train, val,
                                                                tmp_path / "r4"))
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r4").exists()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_trains_adapters_only_and_reloads_with_peft(tmp_path_factory, pretrained, pairs,
                                                         strategy):
    peft = pytest.importorskip("peft")
    import transformers
    from safetensors.torch import load_file
    train, val = pairs
    run_dir = _finetuned(tmp_path_factory, pretrained, train, val,
                         **{**LORA, "trainer.strategy": strategy}).dir
    losses = [m["loss"] for m in read_metrics(run_dir)]
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.05, losses  # the adapters learn
    # frozen: every weight LoRA does not touch is bitwise the pretrained one in the merged model
    base = load_file(str(pretrained / "model.safetensors"))
    merged = load_file(str(run_dir / "model" / "model.safetensors"))
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj")
    untouched = [k for k in base if not any(a in k for a in adapted)]
    assert untouched and all(torch.equal(base[k], merged[k]) for k in untouched)
    assert any(not torch.equal(base[k], merged[k]) for k in base if "q_proj" in k)
    # adapter/ reloads with peft on the base model and reproduces the run's validation loss
    fresh = transformers.AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    with_adapter = peft.PeftModel.from_pretrained(fresh, run_dir / "adapter")
    s = read_summary(run_dir)
    assert _val_loss_on_outputs(pretrained, val, with_adapter) == \
        pytest.approx(s["val_loss"], abs=1e-4)
    # optimizer state per rank: adapters only, against full fine-tuning with the same strategy
    # (ddp: the session's run of the defaults, whose strategy auto picks ddp)
    full = {} if strategy == "ddp" else FULL_FSDP
    full_summary = read_summary(_finetuned(tmp_path_factory, pretrained, train, val, **full).dir)
    assert full_summary["strategy"] == strategy
    lora_opt = s["memory"][0]["optimizer_bytes"]
    full_opt = full_summary["memory"][0]["optimizer_bytes"]
    assert lora_opt <= 0.05 * full_opt, (lora_opt, full_opt)


def test_lora_target_modules_matching_nothing_lists_names(tmp_path, monkeypatch, capsys,
                                                          pretrained, pairs):
    """In this process, through cli.main (test_errors.py checks a real process's exit code)."""
    pytest.importorskip("peft")
    train, val = pairs
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, _finetune_args(pretrained, train, val, tmp_path / "r", **{
        "model.lora.r": 4, "model.lora.target_modules": "[nope]"}))
    assert "model.lora.target_modules" in line and "q_proj" in line, line


def test_finetune_example_runs_with_lora(tmp_path, pretrained):
    pytest.importorskip("peft")
    r = run_cli([str(REPO / "examples" / "finetune.py"), str(pretrained), "--pairs", "120",
                 "--steps", "6", "--run-dir", str(tmp_path / "run")], cwd=tmp_path,
                timeout=240, launcher=[sys.executable])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation loss" in r.stdout and "adapter" in r.stdout
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_early_stopping_stops_where_predicted_and_keeps_the_best(tmp_path, pretrained, pairs):
    """Patience 2, threshold 0.1 on the validation loss (every 2 steps): the run stops at the
    evaluation a reference run without early stopping predicts, and model/ holds the weights of
    the best evaluation (its validation loss, measured again from the files, is that one)."""
    train, val = pairs
    common = {"trainer.max_steps": 24, "trainer.eval_every": 2, "trainer.log_every": 2,
              "optim.lr": 0.1, "optim.warmup_steps": 2}  # too high: the loss jumps at first
    ref = tmp_path / "ref"
    assert run_cli(_finetune_args(pretrained, train, val, ref, **common),
                   cwd=tmp_path).returncode == 0
    evals = [(m["step"], m["val_loss"]) for m in read_metrics(ref) if m.get("val_loss")]
    best, best_step, bad, stop = None, None, 0, None
    for step, v in evals:  # HF's rule: patience counts evals that beat the best by <= threshold
        bad = 0 if best is None or v < best - 0.1 else bad + 1
        if best is None or v < best:
            best, best_step = v, step
        if bad >= 2:
            stop = step
            break
    assert stop is not None and stop < 24 and best_step < stop, evals  # keep_best matters
    run_dir = tmp_path / "es"
    r = run_cli(_finetune_args(pretrained, train, val, run_dir, **common, **{
        "trainer.early_stopping_patience": 2, "trainer.early_stopping_threshold": 0.1,
        "trainer.keep_best": "true"}), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"early stopping at step {stop}" in r.stderr
    s = read_summary(run_dir)
    assert s["steps"] == stop and s["best_step"] == best_step and s["stopped_early"]
    assert read_metrics(run_dir)[-1]["step"] == stop
    assert s["val_loss"] == pytest.approx(best, abs=1e-6)
    assert _val_loss_on_outputs(run_dir / "model", val) == pytest.approx(best, abs=1e-4)
    assert not (run_dir / ".best").exists()


def test_lora_fsdp_killed_and_rerun_ends_bit_identical(tmp_path, tmp_path_factory, pretrained,
                                                        pairs):
    """LoRA under FSDP2 on 2 workers, snapshots every 4 steps: SIGKILL the whole job after a
    committed snapshot, run the same command again: it resumes and ends bit-identical to an
    uninterrupted run (losses, sample ids, merged weights, adapter)."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from tests.distributed._snapshot_helpers import (
        assert_bit_identical,
        committed_steps,
        kill_job,
        wait_for,
    )
    train, val = pairs
    extra = {**LORA, "trainer.strategy": "fsdp"}
    ref = _finetuned(tmp_path_factory, pretrained, train, val, **extra).dir  # LoRA test's too
    run_dir = tmp_path / "killed"
    args = _finetune_args(pretrained, train, val, run_dir, **extra)
    proc = start_cli(args, cwd=tmp_path)
    wait_for(lambda: committed_steps(run_dir / "checkpoints"), proc, timeout=240,
             what="a committed snapshot")
    kill_job(proc)
    assert not (run_dir / "summary.json").exists()
    again = finish(start_cli(args, cwd=tmp_path), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step" in again.stderr
    assert_bit_identical(run_dir, ref)
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (run_dir, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the snapshots hold what changes: the adapters and their optimizer state, not the base
    import math

    from torch.distributed.checkpoint import FileSystemReader
    snaps = sorted((run_dir / "checkpoints").glob("step-*"))
    assert snaps
    adapter = sum(t.numel() for t in a.values())
    base = sum(t.numel() for t in load_file(str(run_dir / "model" / "model.safetensors")).values())
    for snap in snaps:
        meta = FileSystemReader(str(snap)).read_metadata().state_dict_metadata
        numel = {k: math.prod(v.size) for k, v in meta.items() if hasattr(v, "size")}
        weights = [k for k in numel if k.startswith("model.")]
        assert weights and all("lora_" in k for k in weights), weights[:5]
        assert sum(numel[k] for k in weights) == adapter  # weights: the adapters alone
        moments = sum(n for k, n in numel.items() if k.endswith(("exp_avg", "exp_avg_sq")))
        assert moments == 2 * adapter and sum(numel.values()) < 0.1 * base


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_records_train_on_assistant_turns_and_generate_with_the_template(
        tmp_path, monkeypatch, capsys, pretrained, pairs):
    train, _ = pairs
    rows = sorted((json.loads(line) for line in train.read_text().splitlines()),
                  key=lambda r: len(r["input"] + r["output"]))[:48]  # the model has 64 positions
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": r["input"]},
        {"role": "assistant", "content": r["output"]}]}) + "\n" for r in rows))
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    run_dir = tmp_path / "chat"
    r = run_cli(_finetune_args(pretrained, chat, chat, run_dir, **{
        "data.format": "chat", "data.chat_template": str(template), "trainer.max_steps": 6,
        "data.max_length": 64,
        "trainer.devices": "cpu:2", "data.system_prompt": "Answer in one line."}),
        cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    kept, truncated, dropped, empty = map(int, re.search(
        r"48 rows -> (\d+) examples \((\d+) truncated, (\d+) dropped as too long, (\d+) with "
        r"nothing to learn\)", r.stderr).groups())
    assert kept >= 24 and kept + dropped == 48 and empty == 0  # every row has an assistant turn
    assert (run_dir / "model" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert (run_dir / "model" / "tokenizer.json").read_bytes() == \
        (pretrained / "tokenizer.json").read_bytes()
    g = cli_run(capsys, ["generate", str(run_dir), "--prompt", "def read(self):",
                         "--max-new-tokens", "4"])
    assert g.returncode == 0 and g.stdout.startswith("def read(self):"), g.stderr[-2000:]
    # chat data without any template: one line, exit 2 (in this process)
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, _finetune_args(pretrained, chat, chat, tmp_path / "none", **{
        "data.format": "chat"}))
    assert "chat template" in line


def _continued_to(run: Path, snapshot: Path, tmp_path: Path, pretrained: Path, pairs, extra: dict
                  ) -> Path:
    """What the run writes at `snapshot`'s step: the same command continued from it with
    trainer.max_steps at that step (1 worker, so the snapshot is resharded): it trains nothing
    and writes model/ (and adapter/) from the snapshot's weights. Returns that run dir."""
    train, val = pairs
    step = int(snapshot.name.split("-")[1])
    ref = tmp_path / f"continued-{run.parent.name}"
    r = run_cli(_finetune_args(pretrained, train, val, ref, **{
        **extra, "trainer.max_steps": step, "checkpoint.resume": str(snapshot),
        "trainer.devices": "cpu", "trainer.strategy": "auto"}), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {step}" in r.stderr, r.stderr[-3000:]
    return ref


def test_checkpoint_export_of_fine_tuning_snapshots_loads_with_transformers_and_peft(
        tmp_path, tmp_path_factory, pretrained, pairs):
    """`paratrain checkpoint export` of the newest snapshot (step 12 of 16, written by 2 FSDP
    workers) of a full fine-tune (PATH: the run dir) and of a LoRA run (PATH: the snapshot;
    the adapter alone, and --merge): transformers and peft load the folders offline, and their
    logits equal, bitwise, those of the model/ and adapter/ the run writes at that step (the same
    command continued from the snapshot to its step); the tokenizer files are model/'s."""
    peft = pytest.importorskip("peft")
    import transformers

    from paratrain import cli
    train, val = pairs
    auto = transformers.AutoModelForCausalLM
    load = lambda folder: auto.from_pretrained(folder, local_files_only=True).eval()  # noqa: E731
    ids = torch.arange(3, 40).view(1, -1)  # (1, 37) token ids the tiny vocabulary holds

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model(ids).logits  # (1, 37, V)

    base = logits(load(pretrained))
    # full fine-tuning
    run = _finetuned(tmp_path_factory, pretrained, train, val, **FULL_FSDP).dir
    snapshot = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert snapshot.name == "step-0000012"
    ref = _continued_to(run, snapshot, tmp_path, pretrained, pairs, FULL_FSDP)
    assert cli.main(["checkpoint", "export", str(snapshot), str(tmp_path / "full")]) == 0
    exported = logits(load(tmp_path / "full"))
    assert torch.equal(exported, logits(load(ref / "model")))
    assert not torch.allclose(exported, base, atol=1e-3)  # the snapshot's weights, not the base's
    assert not torch.allclose(exported, logits(load(run / "model")), atol=1e-4)  # nor step 16's
    assert cli.main(["checkpoint", "export", str(run), str(tmp_path / "final")]) == 0
    assert torch.equal(logits(load(tmp_path / "final")), logits(load(run / "model")))  # the run's
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "full" / name).read_bytes() == (ref / "model" / name).read_bytes()
    # LoRA: the adapter alone (peft on the base), and merged
    extra = {**LORA, "trainer.strategy": "fsdp"}
    run = _finetuned(tmp_path_factory, pretrained, train, val, **extra).dir
    snapshot = sorted((run / "checkpoints").glob("step-*"))[-1]
    ref = _continued_to(run, snapshot, tmp_path, pretrained, pairs, extra)
    assert cli.main(["checkpoint", "export", str(snapshot), str(tmp_path / "adapter")]) == 0
    assert cli.main(["checkpoint", "export", str(snapshot), str(tmp_path / "merged"),
                     "--merge"]) == 0
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the adapter alone
    with_adapter = logits(peft.PeftModel.from_pretrained(load(pretrained), tmp_path / "adapter"))
    assert torch.equal(with_adapter, logits(peft.PeftModel.from_pretrained(load(pretrained),
                                                                           ref / "adapter")))
    merged = logits(load(tmp_path / "merged"))
    assert torch.equal(merged, logits(load(ref / "model")))
    assert (merged - with_adapter).abs().max() < 1e-5  # merging: the same model
    assert not torch.allclose(merged, base, atol=1e-3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "adapter" / name).read_bytes() == \
            (ref / "adapter" / name).read_bytes()
        assert (tmp_path / "merged" / name).read_bytes() == (ref / "model" / name).read_bytes()


def test_checkpoint_export_of_a_fine_tuning_snapshot_refuses_bad_input(
        tmp_path, tmp_path_factory, capsys, pretrained, pairs):
    """In this process, through cli.main: one line, exit 2, nothing written; a base model that
    moved is named with --model-path."""
    import shutil

    from paratrain import cli
    from paratrain.checkpoint.store import MARKER
    train, val = pairs
    run = _finetuned(tmp_path_factory, pretrained, train, val, **FULL_FSDP).dir
    out = tmp_path / "out"
    line = cli_error(capsys, ["checkpoint", "export", str(run), str(out), "--merge"])
    assert "--merge applies to LoRA snapshots" in line and "full fine-tune" in line
    line = cli_error(capsys, ["checkpoint", "export", str(run), str(tmp_path / "w.safetensors")])
    assert "exports to a folder" in line
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    line = cli_error(capsys, ["checkpoint", "export", str(run), str(busy)])
    assert "not empty" in line and "--overwrite" in line
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    line = cli_error(capsys, ["checkpoint", "export", str(run), str(pretrained), "--overwrite"])
    assert "base model's folder" in line
    # the base model gone from model.path: a copy of the snapshot whose run named another place
    snapshot = sorted((run / "checkpoints").glob("step-*"))[-1]
    moved = tmp_path / "moved" / "checkpoints" / snapshot.name
    shutil.copytree(snapshot, moved)
    marker = json.loads((moved / MARKER).read_text())
    marker["config"]["model"]["path"] = str(tmp_path / "gone")
    template = tmp_path / "template.jinja"  # and that trained with a chat template file
    template.write_text(CHAT_TEMPLATE)
    marker["config"]["data"]["chat_template"] = str(template)
    (moved / MARKER).write_text(json.dumps(marker))
    line = cli_error(capsys, ["checkpoint", "export", str(moved), str(out)])
    assert f"model.path={str(tmp_path / 'gone')!r}" in line and "is gone" in line
    assert "--model-path" in line
    line = cli_error(capsys, ["checkpoint", "export", str(moved), str(out), "--model-path",
                              str(tmp_path / "nowhere")])
    assert "--model-path" in line and "not a model folder" in line
    assert not out.exists() and not (tmp_path / "w.safetensors").exists()
    # --model-path where the base is now: the same export as from the run's own snapshot
    assert cli.main(["checkpoint", "export", str(moved), str(out), "--model-path",
                     str(pretrained)]) == 0
    assert cli.main(["checkpoint", "export", str(snapshot), str(tmp_path / "same")]) == 0
    from safetensors.torch import load_file
    a, b = (load_file(str(d / "model.safetensors")) for d in (out, tmp_path / "same"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE  # as model/ carries it
    template.unlink()  # the template file gone since
    line = cli_error(capsys, ["checkpoint", "export", str(moved), str(tmp_path / "bad"),
                              "--model-path", str(pretrained)])
    assert f"data.chat_template={str(template)!r}" in line and "is gone" in line
    template.write_text(CHAT_TEMPLATE)
    # a shard changed on disk (its size kept): refused before anything is loaded
    shard = sorted(moved.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    line = cli_error(capsys, ["checkpoint", "export", str(moved), str(tmp_path / "bad"),
                              "--model-path", str(pretrained)])
    assert f"{shard.name} does not match its checksum" in line
    assert not (tmp_path / "bad").exists()
    # a path that holds no fine-tuning snapshot takes neither option
    line = cli_error(capsys, ["checkpoint", "export", str(out), str(tmp_path / "x"), "--merge"])
    assert "--merge and --model-path apply to snapshots of fine-tuning runs" in line
