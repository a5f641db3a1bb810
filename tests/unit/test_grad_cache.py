"""GradCache in-process (tasks/embedding/grad_cache.py): a step of two micro-batches, trained as
the loop trains it (the task's `rollout` first, then each micro-batch's loss x scale
backpropagated in turn), gives the gradient of the in-batch-negatives loss over the whole step;
with dropout the second forward draws the masks of the first."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.tasks.embedding.embedder import EmbeddingTask, ranking_losses
from paratrain.tasks.embedding.grad_cache import cache_step, surrogate

transformers = pytest.importorskip("transformers")

B, H = 4, 16


def _bert(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=H, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32,
                                     hidden_dropout_prob=dropout,
                                     attention_probs_dropout_prob=dropout)
    return transformers.BertModel(config, add_pooling_layer=False).train()


def _batch(seed: int, columns: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (columns * B, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, 5:] = 0  # some padded rows
    return {"input_ids": ids, "attention_mask": mask, "columns": columns}


def _task(symmetric: bool) -> EmbeddingTask:
    task = EmbeddingTask.__new__(EmbeddingTask)  # only its config is read by the loss
    task.cfg = TrainConfig()
    task.cfg.embedding.symmetric = symmetric
    return task


def _as_the_loop_trains(task: EmbeddingTask, model, micro: list) -> float:
    """The loop's step: the whole-step seam, then each micro-batch's loss x scale backward."""
    env = SimpleNamespace(device=torch.device("cpu"))
    micro, _ = task.rollout(model, micro, 0, env, contextlib.nullcontext())
    scale = 1.0 / (len(micro) * B)
    total = 0.0
    for mb in micro:
        s, n, _ = task.train_counts(model, mb, torch.device("cpu"), contextlib.nullcontext())
        (s * scale).backward()
        total += float(s.detach())
    return total * scale


@pytest.mark.parametrize("symmetric", [False, True])
def test_accumulated_micro_batches_rank_against_the_whole_step(symmetric):
    task, model = _task(symmetric), _bert(0.0)
    micro = [_batch(1), _batch(2)]
    loss = _as_the_loop_trains(task, model, micro)
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    whole = {"input_ids": torch.cat([torch.cat([m["input_ids"][c * B:(c + 1) * B] for m in micro])
                                     for c in range(3)]),
             "attention_mask": torch.cat([torch.cat([m["attention_mask"][c * B:(c + 1) * B]
                                                     for m in micro]) for c in range(3)]),
             "columns": 3}  # one batch of 2 B triplets: every candidate of the step
    s, n, _ = task.train_counts(model, whole, torch.device("cpu"), contextlib.nullcontext())
    (s / n).backward()
    assert abs(loss - float(s / n)) <= 1e-5
    for k, p in model.named_parameters():
        assert torch.allclose(ours[k], p.grad, rtol=1e-5, atol=1e-5), k


def test_the_second_forward_draws_the_dropout_masks_of_the_first():
    model = _bert(0.3)
    task = _task(False)
    micro = [_batch(1, columns=2), _batch(2, columns=2)]
    embed = lambda b: task.embed(model, b, contextlib.nullcontext())  # noqa: E731
    cached = cache_step(micro, embed, lambda cols: ranking_losses(cols[0], cols[1:], 20.0, False),
                        torch.device("cpu"))
    for mb in cached:  # the replayed embeddings are the cached ones: the value and gradient hold
        with mb["cached"].state.replayed():
            again = embed(mb)
        assert abs(float(surrogate(again, mb["cached"])) - float(mb["cached"].loss_sum)) < 1e-6
        plain = embed(mb)  # a fresh draw: other masks
        assert not torch.allclose(plain[0], again[0])
    exact = []  # the step's loss on the replayed embeddings, differentiated directly
    for mb in cached:
        with mb["cached"].state.replayed():
            exact.append(embed(mb))
    a = torch.cat([e[0] for e in exact])
    ranking_losses(a, [torch.cat([e[1] for e in exact])], 20.0, False).sum().backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    for mb in cached:
        with mb["cached"].state.replayed():
            surrogate(embed(mb), mb["cached"]).backward()
    for k, p in model.named_parameters():
        assert torch.allclose(want[k], p.grad, atol=1e-6), k


def _scored(seed: int) -> dict:
    batch = _batch(seed, columns=2)
    batch["score"] = torch.rand(B, generator=torch.Generator().manual_seed(seed)) * 5  # 0 to 5
    return batch


def test_cosent_under_accumulation_orders_every_pair_of_the_step():
    """embedding.pair_loss=cosent mixes the pairs of a batch: two micro-batches trained as the
    loop trains them give the gradient of CoSENT over all 2 B pairs."""
    task, model = _task(False), _bert(0.0)
    task.cfg.embedding.pair_loss = "cosent"
    micro = [_scored(1), _scored(2)]
    loss = _as_the_loop_trains(task, model, micro)
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    whole = {"input_ids": torch.cat([torch.cat([m["input_ids"][c * B:(c + 1) * B] for m in micro])
                                     for c in range(2)]),
             "attention_mask": torch.cat([torch.cat([m["attention_mask"][c * B:(c + 1) * B]
                                                     for m in micro]) for c in range(2)]),
             "columns": 2, "score": torch.cat([m["score"] for m in micro])}
    s, n, _ = task.train_counts(model, whole, torch.device("cpu"), contextlib.nullcontext())
    (s / n).backward()
    assert abs(loss - float(s / n)) <= 1e-5
    for k, p in model.named_parameters():
        assert torch.allclose(ours[k], p.grad, rtol=1e-5, atol=1e-5), k
