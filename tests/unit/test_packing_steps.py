"""One step on the same examples, packed (data.pack=true) vs padded: the same loss and gradients
(fp32, 1e-5), on the real tasks with a tiny Hugging Face Llama (issue 38): SFT pairs, DPO, KTO,
reward models, and online RL's learning pass on one fixed rollout. The loss is a sum over
counted units divided by their number, so how examples are laid out in rows cannot change it
unless attention leaks between them (or a score is read at the wrong token), which is what these
would catch."""

from __future__ import annotations

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.dist import DistEnv
from paratrain.tasks.base import TaskRecords

transformers = pytest.importorskip("transformers")


def _task(model: str, pack: bool, *extra: str, records: list):
    from paratrain.runtime.rank import prepare_task
    cfg = TrainConfig.from_yaml(None, [
        "model.arch=hf", f"model.path={model}", "data.max_length=96", f"data.pack={pack}",
        "trainer.batch_size=4", "trainer.seed=5", *extra])
    lines: list[str] = []
    task = cfg.task_spec.load().prepare(cfg, DistEnv.single("cpu"), TaskRecords(records), lines.append)
    return task, lines


def _one_step(task) -> tuple[float, dict]:
    """Every training sample once, in micro-batches of 4, as one step: (loss, gradients)."""
    torch.manual_seed(0)
    model = task.build_model().train()
    frozen = {name: m.eval() for name, m in task.build_frozen().items()}
    items = [task.train_ds[i] for i in range(len(task.train_ds))]
    total, units = torch.zeros(()), 0
    for at in range(0, len(items), 4):
        s, n = task.loss(model, task.collate(items[at:at + 4]), torch.device("cpu"),
                         torch.autocast("cpu", enabled=False), frozen)
        total, units = total + s, units + n
    loss = total / units
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()
                         if p.grad is not None}


def _same_step(padded, packed) -> None:
    loss_a, grads_a = _one_step(padded)
    loss_b, grads_b = _one_step(packed)
    assert abs(loss_a - loss_b) <= 1e-5 * max(1.0, abs(loss_a)), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], atol=1e-5, rtol=1e-5, msg=k)


def _pairs(n: int) -> list[dict]:
    from tests.e2e._tiny_model import make_pairs
    return make_pairs(n)


def test_sft_pairs_packed_step_equals_padded_step(pairs_llama):
    records = _pairs(40)
    padded, _ = _task(pairs_llama, False, "data.format=pairs", records=records)
    packed, lines = _task(pairs_llama, True, "data.format=pairs", records=records)
    assert len(packed.train_ds) < len(padded.train_ds)  # several examples per row
    assert packed.train_ds.examples == len(padded.train_ds)
    said = "\n".join(lines)
    assert "data.pack:" in said and "per row on average" in said and "counts rows" in said
    assert "padding: about" in said
    assert packed.padding_share < padded.padding_share
    _same_step(padded, packed)


def test_the_padding_share_is_said_with_what_cuts_it(pairs_llama):
    records = _pairs(40)
    padded, lines = _task(pairs_llama, False, "data.format=pairs", "trainer.batch_size=16",
                          records=records)
    line = next(x for x in lines if x.startswith("padding:"))
    assert padded.padding_share > 0.25 and "data.pack=true" in line, line


def _preference(n: int) -> list[dict]:
    rows = _pairs(n + 1)
    return [{"prompt": a["input"], "chosen": a["output"], "rejected": b["output"]}
            for a, b in zip(rows, rows[1:])]


@pytest.mark.parametrize("objective,extra", [
    ("dpo", ()), ("dpo", ("dpo.loss=ipo",)), ("dpo", ("dpo.precompute_reference=true",)),
    ("kto", ()), ("reward", ())])
def test_preference_packed_step_equals_padded_step(pairs_llama, objective, extra):
    """DPO (its pair terms, the per-token IPO too), KTO (its KL estimate from the mismatched
    half) and a reward model (each sequence scored at its own last token): the same step packed
    and padded; a pair's two sequences stay in one micro-batch."""
    records = _preference(30)
    keys = ["data.format=preference", f"trainer.objective={objective}", *extra]
    padded, _ = _task(pairs_llama, False, *keys, records=records)
    packed, lines = _task(pairs_llama, True, *keys, records=records)
    assert len(packed.train_ds) < len(padded.train_ds) == packed.train_ds.examples
    assert any(x.startswith("data.pack:") for x in lines)
    batch = packed.collate([packed.train_ds[0], packed.train_ds[1]])
    assert packed.count_units(batch) == len(packed.train_ds[0]) + len(packed.train_ds[1])
    _same_step(padded, packed)


def test_plan_says_the_padding_share(pairs_llama, tmp_path, capsys):
    """`paratrain plan` on a fine-tuning config: the padding share, and the line that cuts it."""
    import json

    from paratrain.cli import main
    from tests.e2e._tiny_model import write_jsonl
    data = write_jsonl(tmp_path / "train.jsonl", _pairs(60))
    base = ["plan", "model.arch=hf", f"model.path={pairs_llama}", "data.format=pairs",
            f"data.source={data}", f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.batch_size=16"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "padding: about" in out and "data.pack=true" in out
    assert main(base + ["data.pack=true", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["padding_share"] < 0.25


def count_reward(prompts: list, completions: list, **_: object) -> list:
    """A reward function the RL tasks below load by name (its value is never used here)."""
    return [float(len(c)) for c in completions]


def _rollout(vocab: int, pad: int) -> dict:
    """A fixed batch of 3 prompts x 2 completions as sampling leaves it: prompts (6, 7)
    left-padded, completions (6, 9) right-padded after EOS, the mask a prefix of ones."""
    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, vocab, (6, 7), generator=g)  # (6, 7)
    prompt_mask = torch.ones(6, 7, dtype=torch.long)
    for n, p in enumerate([7, 7, 2, 2, 5, 5]):
        prompt_mask[n, :7 - p] = 0
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, pad)
    completion_ids = torch.randint(3, vocab, (6, 9), generator=g)  # (6, 9)
    completion_mask = torch.zeros(6, 9, dtype=torch.long)
    for n, c in enumerate([9, 1, 4, 9, 2, 6]):
        completion_mask[n, :c] = 1
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": torch.randn(6, generator=g), "loss_mask": completion_mask.float(),
            "old_logps": -torch.rand(6, 9, generator=g) * 4}  # ratios past the clip


def _rl_pass(task, rollout: dict) -> tuple:
    """(the task's loss on the batch, (N, C) log-probs / entropies / values on its mask, the
    gradients of the loss plus the masked values' sum)."""
    torch.manual_seed(0)
    model = task.build_model().train()
    amp = torch.autocast("cpu", enabled=False)
    scores = task._logps(model, rollout, amp, entropy=True)
    mask = rollout["loss_mask"]
    if scores.values is None:  # GRPO / RLOO: their own loss
        loss, _, _ = task.train_counts(model, rollout, torch.device("cpu"), amp)
    else:  # PPO: the log-probs and values its losses read
        loss = (scores.logps * mask).sum() + (scores.values * mask).sum()
    loss.backward()
    kept = [None if x is None else (x * mask).detach() for x in scores]
    return float(loss.detach()), kept, {k: p.grad.clone() for k, p in model.named_parameters()
                               if p.grad is not None}


def _sampled(task, rollout: dict) -> list:
    """The completions the task's model samples from the rollout's prompts (its 3 groups)."""
    from paratrain.tasks.rl.rollout import prompt_generator, sample_completions
    torch.manual_seed(0)
    model = task.build_model()
    ids, mask = rollout["prompt_ids"][::2], rollout["prompt_mask"][::2]  # (3, 7)
    out, _ = sample_completions(model, ids, mask, [prompt_generator(1, 1, i) for i in range(3)],
                                2, task.sampling, task.eos, task.collate.pad_id)
    return out.tolist()


@pytest.mark.parametrize("objective", ["grpo", "rloo", "ppo"])
def test_rl_learning_pass_packed_equals_padded(pairs_llama, objective):
    """Online RL's learning pass on one fixed rollout through the real model: its sequences
    (prompt + completion, padded both ways) packed into rows give the same per-token log-probs,
    entropies and values on the completions' tokens, loss and gradients (1e-5)."""
    keys = ["data.format=prompts", f"trainer.objective={objective}", "rl.num_generations=2",
            "rl.max_new_tokens=9", "rl.reward_functions=[tests.unit.test_packing_steps:"
            "count_reward]"]
    records = [{"prompt": r["input"]} for r in _pairs(8)]
    padded, _ = _task(pairs_llama, False, *keys, records=records)
    packed, _ = _task(pairs_llama, True, *keys, records=records)
    rollout = _rollout(64, padded.collate.pad_id)
    if objective == "rloo":  # its old log-probs are summed per completion
        rollout["old_logps"] = (rollout["old_logps"] * rollout["loss_mask"]).sum(-1)  # (6,)
    from paratrain.tasks.rl.packed_pass import pack_sequences
    rows = pack_sequences(*[rollout[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                 "completion_mask")], 96)
    assert rows.input_ids.numel() < 6 * 16 and len(rows.where) == 31  # fewer tokens, all kept
    loss_a, scores_a, grads_a = _rl_pass(padded, rollout)
    loss_b, scores_b, grads_b = _rl_pass(packed, rollout)
    if objective == "grpo":  # sampling (a KV cache: keys longer than queries) stays padded
        assert _sampled(packed, rollout) == _sampled(padded, rollout)
    assert abs(loss_a - loss_b) <= 1e-5 * max(1.0, abs(loss_a)), (loss_a, loss_b)
    for a, b in zip(scores_a, scores_b):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], atol=1e-5, rtol=1e-5, msg=k)
