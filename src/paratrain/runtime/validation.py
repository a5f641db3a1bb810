"""Validation of one rank, exact whatever the world size: every validation sample is visited once,
and every rank runs the same number of batches (a rank out of samples runs one that counts
nothing), so wrappers that communicate in forward (FSDP) never wait on a rank that has stopped.
The loss is token-weighted over every rank, like training's (loop.py). A task whose samples are
scored against each other (`eval_block`, the embedding task's retrieval) gets whole blocks of
consecutive samples as its batches, the same blocks whatever the world size."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from ..data.sampler import EvalSampler
from ..dist import DistEnv
from ..launch import watchdog
from ..parallel.context import context_split
from ..parallel.pipeline import Pipeline
from ..records.console import ProgressBar
from ..runplan import RunPlan
from ..tasks.base import Frozen, Task


def bound_line(plan: RunPlan, task: Task) -> Optional[str]:
    """The start-up line saying that trainer.eval_samples leaves held-out samples out; None
    when every one is evaluated."""
    bound = plan.cfg.trainer.eval_samples
    held_out = len(task.val_ds) if task.val_ds is not None else 0
    if bound is None or held_out <= bound:
        return None
    return (f"validation: the first {bound:,} of {held_out:,} held-out {task.sample_name} at "
            "each evaluation (trainer.eval_samples; null: every one)")


def eval_batches(n: int, dp: int, data_rank: int, micro_batch: int,
                 block: Optional[int] = None) -> list[list[int]]:
    """This data rank's validation micro-batches (sample indices), as many on every rank (an
    empty one: out of samples). Its EvalSampler share cut into micro-batches, or, with `block`,
    the blocks of `block` consecutive samples (by global index) dealt to the ranks in turn: a
    task that ranks a batch's samples against each other then ranks against the same candidates
    on any number of ranks."""
    if block:
        mine = [list(range(s, min(s + block, n))) for s in range(block * data_rank, n, block * dp)]
        n_batches = math.ceil(math.ceil(n / block) / dp)
    else:
        share = list(EvalSampler(n, dp, data_rank))
        mine = [share[i:i + micro_batch] for i in range(0, len(share), micro_batch)]
        n_batches = math.ceil(math.ceil(n / dp) / micro_batch)
    return mine + [[] for _ in range(n_batches - len(mine))]


class Validation:
    """The validation of one run on this rank: what it reads and how it splits, from the plan."""

    def __init__(self, plan: RunPlan, env: DistEnv, model: nn.Module, task: Task,
                 frozen: Frozen, pipeline: Optional[Pipeline], progress: watchdog.Progress):
        self.plan, self.env, self.model, self.task, self.frozen = plan, env, model, task, frozen
        self.pipeline, self.progress = pipeline, progress
        # a tensor-parallel group reads the same samples; only its first rank's sums count
        self.dp, self.data_rank = plan.dims.dp, plan.dims.data_rank(env.rank)
        self.counts_sums = plan.dims.reports_sums(env.rank)
        self.split = context_split(plan.dims, env.rank)  # a CP rank's chunks of each sequence

    def _batch(self, mb: Any) -> tuple[Any, int, dict]:
        """(loss sum, loss units, counts) for one validation micro-batch. A task may count more
        than the loss (`eval_counts`, e.g. right predictions): `run` sums those too."""
        dev = self.env.device
        amp = self.plan.parallelism.autocast(self.plan.precision, dev)
        mb = self.split.batch(mb) if self.split is not None else mb
        return self.task.eval_counts(self.model, mb, dev, amp, self.frozen)

    @torch.no_grad()
    def run(self, step: int) -> tuple[Optional[float], Optional[dict]]:
        """(token-weighted validation loss over every sample once, the task's figures from its
        extra counts: `eval_counts` summed the same way, turned into figures by `eval_metrics`;
        None when it has none)."""
        env, tr, collate = self.env, self.plan.cfg.trainer, self.task.collate
        self.progress.at(step, "eval")
        val_ds = self.task.val_ds
        n = len(val_ds) if val_ds is not None else 0
        if tr.eval_samples is not None:
            n = min(n, tr.eval_samples)
        if n == 0:
            return None, None
        b = self.plan.micro_batch
        batches = eval_batches(n, self.dp, self.data_rank, b, self.task.eval_block)
        was_training = self.model.training
        self.model.eval()
        if self.pipeline is not None:  # forward only through the stages; the last one sums
            total, count = self.pipeline.evaluate(
                [collate([val_ds[j] for j in idx]) if idx else None for idx in batches],
                b, self.plan.cfg.data.seq_length)
            self.model.train(was_training)
            return env.weighted_mean(total, count), None
        total = count = 0.0
        extra: dict = {}  # the task's counts, summed
        # a bar on rank 0 when validation lasts more than 2 s (the final one: ~20 s by default)
        bar = ProgressBar(env, len(batches), enabled=tr.progress_bar, desc="validation",
                          unit="batch", leave=False, delay_s=2.0)
        for idx in batches:
            if idx:
                s, c, counts = self._batch(collate([val_ds[j] for j in idx]))
                for key, value in counts.items():
                    extra[key] = extra.get(key, 0.0) + (float(value) if self.counts_sums else 0.0)
            else:  # out of samples: keep step with the other ranks, count nothing
                _, _, counts = self._batch(collate([val_ds[0]]))
                for key in counts:  # the same keys on every rank, for the sum below
                    extra.setdefault(key, 0.0)
                s, c = 0.0, 0
            if self.counts_sums:  # a tensor-parallel peer computed the same sums: counted once
                total += float(s)
                count += c
            bar.update(1)
        bar.close()
        self.model.train(was_training)
        metrics = None
        if extra:  # every rank ran >= 1 batch of the same task: the same keys
            keys = sorted(extra)
            summed = env.all_reduce_sum([extra[k] for k in keys]).tolist()
            metrics = self.task.eval_metrics(dict(zip(keys, summed)))
        return env.weighted_mean(total, count), metrics
