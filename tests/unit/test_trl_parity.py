"""Parity with TRL 1.16 on the same batch: paratrain's tasks (prepared from a config as a run
prepares them) and TRL's own trainers (`compute_loss`, driven on the same model, reference and
token ids), step after step while the policy trains. Skipped without the `trl` package."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytestmark = [pytest.mark.slow]  # TRL's trainers are built (seconds each)
from torch.nn.utils.rnn import pad_sequence  # noqa: E402

from paratrain.config import TrainConfig  # noqa: E402
from paratrain.dist import DistEnv  # noqa: E402
from paratrain.runtime.rank import prepare_task  # noqa: E402
from tests.conftest import make_hf_llama  # noqa: E402

WORDS = "the red cat sees a dog a small bird runs near the tree eats sits".split()
CPU, AMP = torch.device("cpu"), contextlib.nullcontext()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_hf_llama(tmp_path_factory.mktemp("trl") / "m", [" ".join(WORDS)] * 20,
                         vocab_size=300)


def _phrase(rnd: random.Random, lo: int, hi: int) -> str:
    return " ".join(rnd.choices(WORDS, k=rnd.randint(lo, hi)))


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    return [{"prompt": _phrase(rnd, 2, 6), "chosen": " " + _phrase(rnd, 1, 5),
             "rejected": " " + _phrase(rnd, 1, 7)} for _ in range(n)]


def prepared(model_dir: Path, tmp_path: Path, rows: list[dict], *overrides: str):
    """(the task a run prepares, its policy, its frozen models), the policy nudged off the
    reference so that the log-ratios are not all zero."""
    source = tmp_path / "train.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = TrainConfig.from_yaml(None, [
        "model.arch=hf", f"model.path={model_dir}", f"data.source={source}",
        "data.val_fraction=0", f"run.dir={tmp_path / 'run'}", *overrides])
    task = prepare_task(cfg, DistEnv.single("cpu"), quiet=True)
    model, frozen = task.build_model(), task.build_frozen()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return task, model, frozen


def padded(rows: list[list[int]], starts: list[int], pad_id: int) -> dict:
    """TRL's batch of whole sequences: input_ids, attention_mask, completion_mask (1 from each
    row's completion start), right-padded as its collators pad."""
    return {"input_ids": pad_sequence([torch.as_tensor(r) for r in rows], batch_first=True,
                                      padding_value=pad_id),
            "attention_mask": pad_sequence([torch.ones(len(r), dtype=torch.long) for r in rows],
                                           batch_first=True),
            "completion_mask": pad_sequence([torch.tensor([0] * s + [1] * (len(r) - s))
                                             for r, s in zip(rows, starts)], batch_first=True)}


def trl_args(config_class, tmp_path: Path, **kw):
    """TRL's config in float32 (its default, bf16=True, would run the reference under bf16
    autocast, which paratrain's fp32 run does not)."""
    return config_class(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True,
                        bf16=False, logging_strategy="no", save_strategy="no", **kw)


def _train_in_step(model, loss, lr: float = 0.05) -> None:
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
                p.grad = None


@pytest.mark.parametrize("loss_type", ["ipo", "sigmoid"])
def test_dpo_losses_equal_trls_step_after_step(llama, tmp_path, loss_type):
    """dpo.loss=ipo is TRL's IPO (log-probs averaged per response token); sigmoid as before.
    Four steps of 4 pairs, the policy trained by paratrain's loss in between: each step's loss
    equals TRL's DPOTrainer.compute_loss on the same pairs within 1e-5, and the rewards and
    accuracy are logged under TRL's names too."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    rows = preference_rows(16)
    task, model, frozen = prepared(llama, tmp_path, rows, "data.format=preference",
                                   f"dpo.loss={loss_type}", "dpo.beta=0.3")
    trainer = DPOTrainer(model=model, ref_model=frozen["reference"],
                         args=trl_args(DPOConfig, tmp_path, loss_type=[loss_type], beta=0.3),
                         train_dataset=Dataset.from_list(rows), processing_class=task.tokenizer)
    pad = task.tokenizer.pad_token_id
    model.train()  # as the loop has it (TRL files its figures under "train" then)
    for step in range(4):
        pairs = [task.train_ds[i] for i in range(4 * step, 4 * step + 4)]
        s, n, counts = task.train_counts(model, task.collate(pairs), CPU, AMP, frozen)
        ours = s / n
        theirs = trainer.compute_loss(model, padded(
            [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
            [p["prompt_len"] for p in pairs] * 2, pad))
        assert abs(ours.item() - theirs.item()) <= 1e-5, (step, ours.item(), theirs.item())
        _train_in_step(model, ours)
    figures = task.train_metrics({k: float(v) for k, v in counts.items()})
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert figures[name] == pytest.approx(theirs[name], abs=1e-5), name


def kto_rows(n: int, seed: int = 2) -> list[dict]:
    rnd = random.Random(seed)
    return [{"prompt": _phrase(rnd, 2, 6), "completion": " " + _phrase(rnd, 1, 6),
             "label": rnd.random() < 0.6} for _ in range(n)]


def test_kto_loss_equals_trls_over_16_steps(llama, tmp_path):
    """trainer.objective=kto on unpaired records, unequal weights: 16 steps of 4 examples
    (mismatched sequences made by paratrain, scored by both), each step's loss equal to TRL's
    KTOTrainer.compute_loss within 1e-5, the policy trained by paratrain's loss in between;
    the rewards and the KL estimate logged under TRL's names, with its values."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer
    rows = kto_rows(64)
    task, model, frozen = prepared(llama, tmp_path, rows, "data.format=preference",
                                   "trainer.objective=kto", "kto.beta=0.2",
                                   "kto.desirable_weight=1.0", "kto.undesirable_weight=1.3")
    args = trl_args(KTOConfig, tmp_path, beta=0.2, desirable_weight=1.0, undesirable_weight=1.3,
                    per_device_train_batch_size=4)
    trainer = KTOTrainer(model=model, ref_model=frozen["reference"], args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=task.tokenizer)
    pad, worst = task.tokenizer.pad_token_id, 0.0
    model.train()
    for step in range(16):
        examples = [task.train_ds[i] for i in range(4 * step, 4 * step + 4)]
        s, n, counts = task.train_counts(model, task.collate(examples), CPU, AMP, frozen)
        starts = [ex["prompt_len"] for ex in examples]
        inputs = padded([ex["completion"] for ex in examples], starts, pad)
        inputs.update({f"KL_{k}": v for k, v in padded(
            [ex["mismatched"] for ex in examples], starts, pad).items()})
        inputs["label"] = torch.tensor([bool(ex["label"]) for ex in examples])
        theirs = trainer.compute_loss(model, inputs)
        worst = max(worst, abs((s / n).item() - theirs.item()))
        assert worst <= 1e-5, (step, (s / n).item(), theirs.item())
        _train_in_step(model, s / n)
    figures = task.train_metrics({k: float(v) for k, v in counts.items()})
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        if name in logged:
            assert figures[name] == pytest.approx(logged[name], abs=1e-5), name
    assert figures["kl"] >= 0


def trl_pairs(pairs: list[dict], pad: int) -> dict:
    """TRL's ORPO / CPO batch of the same token ids: each side's whole sequences, right-padded,
    their attention masks and labels (-100 over the prompt and the pads)."""
    out = {}
    for side in ("chosen", "rejected"):
        rows = [torch.as_tensor(p[side]) for p in pairs]
        labels = [torch.cat([torch.full((p["prompt_len"],), -100), r[p["prompt_len"]:]])
                  for p, r in zip(pairs, rows)]
        out[f"{side}_input_ids"] = pad_sequence(rows, batch_first=True, padding_value=pad)
        out[f"{side}_attention_mask"] = pad_sequence(
            [torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True)
        out[f"{side}_labels"] = pad_sequence(labels, batch_first=True, padding_value=-100)
    return out


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_orpo_and_simpo_equal_trls_step_after_step(llama, tmp_path, objective):
    """trainer.objective=orpo is TRL's ORPOTrainer, simpo its CPOTrainer with loss_type=simpo
    (trl.experimental in TRL 1.16): 8 steps of one pair, the policy trained by paratrain's loss
    in between, each step's loss equal to TRL's compute_loss within 1e-5; then on a batch of 4
    pairs the figures TRL averages per pair (rewards, accuracy, log odds) are TRL's."""
    from datasets import Dataset
    rows = preference_rows(12, seed=3)
    if objective == "orpo":
        from trl.experimental.orpo import ORPOConfig as TRLConfig, ORPOTrainer as TRLTrainer
        keys, kw = ["orpo.beta=0.3"], {"beta": 0.3}
    else:
        from trl.experimental.cpo import CPOConfig as TRLConfig, CPOTrainer as TRLTrainer
        keys = ["simpo.beta=2.0", "simpo.gamma=0.7", "simpo.cpo_alpha=0.4"]
        kw = {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.7, "cpo_alpha": 0.4}
    task, model, frozen = prepared(llama, tmp_path, rows, "data.format=preference",
                                   f"trainer.objective={objective}", *keys)
    assert frozen == {}  # no reference model
    trainer = TRLTrainer(model=model, args=trl_args(TRLConfig, tmp_path, **kw),
                         train_dataset=Dataset.from_list(rows), processing_class=task.tokenizer)
    pad = task.tokenizer.pad_token_id
    model.train()
    for step in range(8):
        pair = [task.train_ds[step]]
        s, n, _ = task.train_counts(model, task.collate(pair), CPU, AMP, frozen)
        theirs = trainer.compute_loss(model, trl_pairs(pair, pad))
        assert n == 1 and abs(s.item() - theirs.item()) <= 1e-5, (step, s.item(), theirs.item())
        _train_in_step(model, s / n)
    pairs = [task.train_ds[i] for i in range(8, 12)]
    _, _, counts = task.train_counts(model, task.collate(pairs), CPU, AMP, frozen)
    _, logged = trainer.compute_loss(model, trl_pairs(pairs, pad), return_outputs=True)
    figures = task.train_metrics({k: float(v) for k, v in counts.items()})
    names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"]
    for name in names + (["log_odds_ratio", "log_odds_chosen"] if objective == "orpo" else []):
        assert figures[name] == pytest.approx(float(logged[name]), abs=1e-5), name


# Zephyr's template: each turn ends "</s>\n", so a response's text runs on past its EOS
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    return make_hf_llama(tmp_path_factory.mktemp("trl-chat") / "m", [" ".join(WORDS)] * 20,
                         vocab_size=300, chat_template=CHAT)


def _ids(row) -> list[int]:
    return [int(i) for i in row]


def _turn(role: str, text: str) -> list[dict]:
    return [{"role": role, "content": text}]


def chat_pairs(n: int, seed: int = 3) -> list[dict]:
    rnd = random.Random(seed)
    return [{"prompt": _turn("user", _phrase(rnd, 2, 6)),
             "chosen": _turn("assistant", _phrase(rnd, 1, 5) + " cat"),
             "rejected": _turn("assistant", _phrase(rnd, 1, 5) + " dog")} for _ in range(n)]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_with_after_eos_keep_equals_trl_on_its_own_token_ids(chat_llama, tmp_path,
                                                                 loss_type):
    """dpo.after_eos=keep on a file of chat messages: paratrain's token ids are those TRL's
    DPOTrainer makes of the same records with the same template (the "</s>\\n" after each
    response kept), and each step's loss equals TRL's compute_loss on its own collated batch
    within 1e-5, the policy trained in between. (With the default, drop, the ids end at EOS.)"""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    rows = chat_pairs(8)
    task, model, frozen = prepared(chat_llama, tmp_path, rows, "data.format=preference",
                                   f"dpo.loss={loss_type}", "dpo.beta=0.3", "dpo.after_eos=keep")
    trainer = DPOTrainer(model=model, ref_model=frozen["reference"],
                         args=trl_args(DPOConfig, tmp_path, loss_type=[loss_type], beta=0.3),
                         train_dataset=Dataset.from_list(rows), processing_class=task.tokenizer)
    theirs = [trainer.train_dataset[i] for i in range(len(rows))]
    assert len(task.train_ds) == len(theirs)
    for ours, t in zip((task.train_ds[i] for i in range(len(rows))), theirs):
        assert ours["prompt_len"] == len(t["prompt_ids"])
        assert _ids(ours["chosen"]) == t["prompt_ids"] + t["chosen_ids"]
        assert _ids(ours["rejected"]) == t["prompt_ids"] + t["rejected_ids"]
    model.train()
    for step in range(4):
        picked = [(2 * step + k) % len(rows) for k in range(4)]
        s, n, _ = task.train_counts(model, task.collate([task.train_ds[i] for i in picked]),
                                    CPU, AMP, frozen)
        trl_loss = trainer.compute_loss(model, trainer.data_collator([theirs[i] for i in picked]))
        assert abs((s / n).item() - trl_loss.item()) <= 1e-5, (step, (s / n).item(),
                                                               trl_loss.item())
        _train_in_step(model, s / n)


def test_kto_with_after_eos_keep_equals_trl_on_its_own_token_ids(chat_llama, tmp_path):
    """trainer.objective=kto, dpo.after_eos=keep, unpaired chat records in one batch (TRL pairs
    each prompt with the previous completion within a batch, paratrain within the source: the
    same pairs when the source is one batch): TRL's KTOTrainer's own ids and collated batch
    give its loss, equal to paratrain's within 1e-5 over 4 steps."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer
    rnd = random.Random(4)
    rows = [{"prompt": _turn("user", _phrase(rnd, 2, 6)),
             "completion": _turn("assistant", _phrase(rnd, 1, 6)), "label": i % 3 != 0}
            for i in range(8)]
    task, model, frozen = prepared(chat_llama, tmp_path, rows, "data.format=preference",
                                   "trainer.objective=kto", "kto.beta=0.2",
                                   "kto.undesirable_weight=1.3", "dpo.after_eos=keep")
    args = trl_args(KTOConfig, tmp_path, beta=0.2, undesirable_weight=1.3,
                    per_device_train_batch_size=len(rows))
    trainer = KTOTrainer(model=model, ref_model=frozen["reference"], args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=task.tokenizer)
    theirs = [trainer.train_dataset[i] for i in range(len(rows))]
    ours = [task.train_ds[i] for i in range(len(rows))]
    for o, t in zip(ours, theirs):
        assert _ids(o["completion"]) == t["prompt_ids"] + t["completion_ids"]
        assert _ids(o["mismatched"]) == t["prompt_ids"] + t["KL_completion_ids"]
    model.train()
    for step in range(4):
        s, n, _ = task.train_counts(model, task.collate(ours), CPU, AMP, frozen)
        trl_loss = trainer.compute_loss(model, trainer.data_collator(theirs))
        assert abs((s / n).item() - trl_loss.item()) <= 1e-5, (step, (s / n).item(),
                                                               trl_loss.item())
        _train_in_step(model, s / n)
