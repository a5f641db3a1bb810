"""DPO end to end and offline (data.format=preference): a tiny Llama built here from a transformers
config, with a BPE tokenizer trained here, on synthetic pairs whose chosen responses mention a
keyword the rejected ones lack. Real worker processes: at step 1 (policy = reference) the loss is
log 2 and the rewards are 0; 1 worker accumulating and 2 DDP workers (the task contract's runs,
tests/e2e/test_task_contract.py) and 2 under FSDP give the same losses and reward figures, and
so do reference log-probs precomputed once; the full reference
stays bitwise the model it was loaded from; LoRA
DPO under FSDP is killed after a committed snapshot and the same command ends bit-identical,
with snapshots of the adapters alone; the Python API's lists learn the preference."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests._runs import Run
from tests.conftest import (
    REPO,
    cli_error,
    finish,
    read_metrics,
    read_summary,
    run_cli,
    start_cli,
)
from tests.e2e._preference_data import (
    N_VAL,
    preference_rows,
    small_run_args,
    write_jsonl,
)

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900)]

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "accuracy")


@pytest.fixture(scope="module")
def llama(preference_llama) -> Path:
    return preference_llama  # the session's (tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def data(preference_data) -> tuple[Path, Path]:
    return preference_data


def dpo_args(model: Path, train: Path, val: Path, run_dir: Path, **extra) -> list[str]:
    return small_run_args(model, train, val, run_dir, **{"data.format": "preference", **extra})


CHECKED = """
import json, sys
sys.path.insert(0, {repo!r})
from paratrain import Trainer, TrainConfig
from paratrain.dist import DistEnv
from tests.e2e._dpo_checked import CheckedDPOTask

if __name__ == "__main__":
    cfg = TrainConfig.from_yaml(None, {overrides!r})
    task = CheckedDPOTask.prepare(cfg, DistEnv.single("cpu"), None, print)
    task.report_dir = {report!r}
    Trainer(task=task, devices="cpu:2", strategy="fsdp", max_steps=4, batch_size=4,
            global_batch_size=8, log_every=1, eval_every=1000, lr=3e-3, warmup_steps=0,
            progress_bar=False, run_dir={run_dir!r}, verbose=True,
            distributed_config={{"timeout_s": 60}}).fit()
"""


@pytest.fixture(scope="module")
def contract(tmp_path_factory, contract_inputs) -> tuple[Run, Run]:
    """The task contract's DPO runs (tests/e2e/test_task_contract.py, 4 steps: 1 worker
    accumulating 2 micro-batches and 2 DDP workers agree; a killed run resumes bit-identical):
    what the other layouts here must reproduce."""
    from tests.e2e.test_task_contract import runs_of
    return runs_of(tmp_path_factory, ("preference", "dpo"), contract_inputs)


@pytest.fixture(scope="module")
def one_worker(contract) -> Path:
    assert "reference: a frozen copy of model.path" in contract[0].stderr
    return contract[0].dir


@pytest.mark.slow
def test_step_one_is_log_2_and_one_two_workers_and_fsdp_agree(tmp_path, llama, contract,
                                                               one_worker):
    """The contract's 1 worker and 2 DDP workers; 2 under FSDP (through the Python API with a
    task that checks its reference on every micro-step): the same losses and reward figures,
    step 1 at log 2 with zero rewards, and the same final validation figures."""
    runs = {"one": one_worker, "ddp": contract[1].dir}
    overrides = contract[1].overrides
    report = tmp_path / "checks"
    report.mkdir()
    script = tmp_path / "checked.py"
    script.write_text(CHECKED.format(repo=str(REPO), overrides=overrides, report=str(report),
                                     run_dir=str(tmp_path / "fsdp")))
    r = run_cli([str(script)], cwd=tmp_path, timeout=300, launcher=[sys.executable])
    assert r.returncode == 0, r.stderr[-3000:]
    runs["fsdp"] = tmp_path / "fsdp"
    # the reference was checked bitwise against model.path on every micro-step of both ranks
    # (4 steps, one micro-step each) and in every final validation batch
    checks = [int(p.read_text()) for p in report.glob("*.checks")]
    assert len(checks) == 2 and all(c > 4 for c in checks), checks
    assert "frozen MB" in r.stderr  # the reference's memory is in the verbose memory table

    metrics = {name: read_metrics(d) for name, d in runs.items()}
    first = metrics["one"][0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["accuracy"] == 0.0
    assert all(abs(first[k]) < 1e-7 for k in REWARDS[:3]), first
    assert metrics["one"][-1]["loss"] < first["loss"]  # it learns
    for name in ("ddp", "fsdp"):
        assert len(metrics[name]) == 4
        for a, b in zip(metrics["one"], metrics[name]):
            for key in ("loss",) + REWARDS:
                assert a[key] == pytest.approx(b[key], abs=1e-5), (name, a["step"], key)
    summaries = {name: read_summary(d) for name, d in runs.items()}
    for name in ("ddp", "fsdp"):
        s, one = summaries[name], summaries["one"]
        assert s["val_samples"] == one["val_samples"] == N_VAL
        for key in ("val_loss", "val_accuracy", "val_rewards/margin"):
            assert s[key] == pytest.approx(one[key], abs=1e-5), (name, key)
    memory = summaries["fsdp"]["memory"]
    params = 4 * sum(t.numel() for t in _weights(llama).values())
    assert [m["frozen_bytes"] for m in memory] == [m["params_bytes"] for m in memory]
    assert sum(m["frozen_bytes"] for m in memory) == params  # sharded, not replicated


@pytest.mark.slow
def test_precomputed_reference_log_probs_give_the_same_run(tmp_path, contract, one_worker):
    """dpo.precompute_reference=true on 2 workers: the calling process computes the reference's
    log-probs once and caches them (the workers read them; no reference is held), and the run
    is the one with a frozen reference."""
    cache = tmp_path / "cache"
    r = run_cli(["train"] + contract[1].overrides + [  # the contract's 2-worker run's settings
        "dpo.precompute_reference=true", f"data.cache_dir={cache}", f"run.dir={tmp_path / 'pre'}"],
        cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("reference log-probs of") == 2  # train and validation, once each
    assert "reference: log-probabilities computed once before training" in r.stderr
    assert len(list((cache / "dpo-reference").glob("*.npy"))) == 2
    assert "frozen_bytes" not in read_summary(tmp_path / "pre")["memory"][0]
    for a, b in zip(read_metrics(one_worker), read_metrics(tmp_path / "pre")):
        # at step 1 every pair is a tie (policy = reference) that rounding breaks either way:
        # log-probs computed in other batches differ in the last bits, so its accuracy is noise
        for key in ("loss",) + REWARDS[:3] + (("accuracy",) if a["step"] > 1 else ()):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)
    assert read_summary(tmp_path / "pre")["val_loss"] == pytest.approx(
        read_summary(one_worker)["val_loss"], abs=1e-5)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_lora_dpo_fsdp_killed_and_rerun_ends_bit_identical(tmp_path, llama, data):
    """LoRA DPO (reference: the policy with its adapters off) under FSDP on 2 workers, a
    snapshot every 4 steps: SIGKILL the whole job after a committed snapshot, run the same
    command again: it resumes and ends bit-identical to an uninterrupted run (losses, reward
    figures, sample ids, merged weights, adapter); the snapshots hold the adapters and their
    optimizer state only."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from tests.distributed._snapshot_helpers import (
        assert_bit_identical,
        committed_steps,
        kill_job,
        wait_for,
    )
    train, val = data
    extra = {"model.lora.r": 4, "model.lora.target_modules": "[q_proj,v_proj]",
             "trainer.strategy": "fsdp", "trainer.max_steps": 12, "trainer.log_every": 2,
             "checkpoint.every_steps": 4, "checkpoint.record_samples": "true",
             "optim.lr": 1e-2}
    ref = tmp_path / "ref"
    r = run_cli(dpo_args(llama, train, val, ref, **extra), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reference: the policy with its LoRA adapters off" in r.stderr
    assert "frozen MB" not in r.stderr and "frozen_bytes" not in read_summary(ref)["memory"][0]
    run_dir = tmp_path / "killed"
    args = dpo_args(llama, train, val, run_dir, **extra)
    proc = start_cli(args, cwd=tmp_path)
    wait_for(lambda: committed_steps(run_dir / "checkpoints"), proc, timeout=240,
             what="a committed snapshot")
    kill_job(proc)
    assert not (run_dir / "summary.json").exists()
    again = finish(start_cli(args, cwd=tmp_path), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step" in again.stderr
    assert_bit_identical(run_dir, ref)
    got, want = read_metrics(run_dir), read_metrics(ref)
    assert [[m[k] for k in REWARDS] for m in got] == [[m[k] for k in REWARDS] for m in want]
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (run_dir, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    adapter = sum(t.numel() for t in a.values())
    snaps = sorted((run_dir / "checkpoints").glob("step-*"))
    assert snaps
    for snap in snaps:
        meta = FileSystemReader(str(snap)).read_metadata().state_dict_metadata
        numel = {k: math.prod(v.size) for k, v in meta.items() if hasattr(v, "size")}
        weights = [k for k in numel if k.startswith("model.")]
        assert weights and all("lora_" in k for k in weights), weights[:5]
        assert sum(numel[k] for k in weights) == adapter
        moments = sum(n for k, n in numel.items() if k.endswith(("exp_avg", "exp_avg_sq")))
        assert moments == 2 * adapter


@pytest.mark.slow
def test_python_api_lists_learn_the_preference(tmp_path, llama, monkeypatch):
    """Trainer(model=DIR, train_prompts=, train_chosen=, train_rejected=, objective="dpo"): after
    60 steps the validation reward accuracy is >= 0.9 and the margin grew at every evaluation;
    the saved policy prefers the chosen responses itself (its log-prob margin over the
    reference, measured here with transformers, is the one the run reported)."""
    from paratrain import Trainer
    monkeypatch.chdir(tmp_path)
    rows, val = preference_rows(240, 2), preference_rows(N_VAL, 3)
    result = Trainer(model=str(llama), objective="dpo",
                     train_prompts=[r["prompt"] for r in rows],
                     train_chosen=[r["chosen"] for r in rows],
                     train_rejected=[r["rejected"] for r in rows],
                     validation_prompts=[r["prompt"] for r in val],
                     validation_chosen=[r["chosen"] for r in val],
                     validation_rejected=[r["rejected"] for r in val],
                     devices="cpu", max_steps=60, batch_size=8, eval_every=20, log_every=10,
                     lr=3e-3, warmup_steps=5, progress_bar=False,
                     run_dir=str(tmp_path / "api")).fit()
    s = result.summary
    assert result.steps == 60 and s["val_samples"] == N_VAL
    assert s["val_accuracy"] >= 0.9
    margins = [m["val_rewards/margin"] for m in read_metrics(tmp_path / "api")
               if "val_rewards/margin" in m] + [s["val_rewards/margin"]]
    assert len(margins) == 3 and margins[0] < margins[1] < margins[2], margins
    measured = _margin_with_transformers(tmp_path / "api" / "model", llama, val)
    assert measured == pytest.approx(s["val_rewards/margin"], abs=1e-5)


def _margin_with_transformers(policy_dir: Path, reference_dir: Path, rows: list[dict],
                              beta: float = 0.1) -> float:
    """Mean over pairs of beta * ((log pi - log ref)(chosen) - (log pi - log ref)(rejected)),
    response tokens only, each text scored alone with plain transformers."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(reference_dir, local_files_only=True)
    models = [transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
              for d in (policy_dir, reference_dir)]

    def logp(model, prompt: str, response: str) -> float:
        head = tok(prompt)["input_ids"]  # with the tokenizer's own specials (here: none)
        tail = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([head + tail])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float().log_softmax(-1)  # (T-1, V)
        picked = logits.gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,)
        return float(picked[len(head) - 1:].sum())

    total = 0.0
    for r in rows:
        ratio = [logp(models[0], r["prompt"], r[k]) - logp(models[1], r["prompt"], r[k])
                 for k in ("chosen", "rejected")]
        total += beta * (ratio[0] - ratio[1])
    return total / len(rows)


def test_plan_counts_the_reference(tmp_path, llama, data, capsys):
    """`paratrain plan` for DPO: the frozen reference is a column of its own, as large as the
    policy's parameters and sharded like them; LoRA's reference (adapters off) and precomputed
    log-probs hold none, and LoRA keeps gradients and optimizer state for the adapters only."""
    from paratrain.cli import main
    args = dpo_args(llama, *data, tmp_path / "plan")[1:]

    def plan(*extra: str) -> dict:
        assert main(["plan", *args, *extra, "--json"]) == 0
        return {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    full, lora = plan(), plan("model.lora.r=4")
    pre = plan("dpo.precompute_reference=true", f"data.cache_dir={tmp_path / 'cache'}")
    params = 4 * sum(t.numel() for t in _weights(llama).values())
    assert full["ddp"]["frozen_bytes"] == full["ddp"]["params_bytes"] == params
    assert full["fsdp"]["frozen_bytes"] == params // 2
    assert lora["ddp"]["frozen_bytes"] == pre["ddp"]["frozen_bytes"] == 0
    assert 0 < lora["ddp"]["optimizer_bytes"] < 0.2 * full["ddp"]["optimizer_bytes"]
    assert pre["ddp"]["device_bytes"] == full["ddp"]["device_bytes"] - params


def test_bad_preference_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch,
                                                                     capsys, llama, data):
    """A bad key, and data with nothing to prefer (refused in the launching process, before any
    worker starts): one line, exit 2, nothing written. In this process through cli.main, as
    tests/unit/test_preference.py checks the rest (test_errors.py checks the exit code of a
    real process)."""
    train, val = data
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, dpo_args(llama, train, val, tmp_path / "r1", **{"dpo.beta": -1}))
    assert line == "paratrain: error: dpo.beta=-1.0 must be positive (the DPO paper uses " \
                   "0.1 to 0.5)", line
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " b"}
                                                 for _ in range(8)])
    line = cli_error(capsys, dpo_args(llama, same, val, tmp_path / "r2"))
    assert "every pair of" in line and "chosen = rejected" in line, line
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


@pytest.mark.slow
def test_dpo_example_runs_with_lora(tmp_path, llama):
    pytest.importorskip("peft")
    r = run_cli([str(REPO / "examples" / "dpo.py"), str(llama), "--pairs", "120", "--steps",
                 "4", "--run-dir", str(tmp_path / "run")], cwd=tmp_path, timeout=300,
                launcher=[sys.executable])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reward accuracy" in r.stdout and "reward margin" in r.stdout
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert read_summary(tmp_path / "run")["world_size"] == 2
