"""The training loop of one rank: the nanoGPT loop, made exact across world sizes.

- Every global batch is the same set of samples whatever the world size (GlobalSampler).
- The loss is a token-weighted mean over all ranks and micro-steps: each micro-step backpropagates
  sum(token losses) * dp / (tokens in the global batch), and the data-parallel gradient mean
  over the dp ranks undoes the `* dp`, so the gradient does not depend on how the batch was split.
  (dp is the world size unless tensor parallelism makes groups of ranks share one batch: then
  the plan's ParallelDims says which slice a rank reads and whether its sums count.)
- Validation visits every sample exactly once, and every rank runs the same number of batches
  (a rank out of samples runs a dummy batch that counts nothing), so wrappers that communicate in
  forward (FSDP) never wait on a rank that has stopped.
What is trained (model, data, loss) comes in as a task (task.py); how it is spread over devices,
the batch plan and the number of steps come in as the run plan (runplan.py), decided before the
workers started: the loop derives none of them.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..checkpoint.snapshotter import Resumed, Snapshotter
from ..data.sampler import EvalSampler, GlobalSampler, SampleRecorder, StepBatches
from ..dist import DistEnv
from ..launch import watchdog
from ..launch.preemption import StopSignals, stop_line
from ..parallel.memory import SavedTensorMeter, format_memory_table, gather_memory, local_bytes
from ..parallel.pipeline import Pipeline
from ..records import loggers
from ..records.console import ProgressBar
from ..records.metrics import MetricsLog, Throughput
from ..runplan import RunPlan
from ..tasks.base import NO_FROZEN, Frozen, Task
from .early_stop import BestTracker
from .loader import step_loader


class TrainLoop:
    """The training loop of one rank; state lives here so a snapshot can save it."""

    def __init__(self, plan: RunPlan, env: DistEnv, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, task: Task, *,
                 snapshots: Optional[Snapshotter] = None, resumed: Optional[Resumed] = None,
                 on_best: Optional[Callable[[int], None]] = None,
                 stop: Optional[StopSignals] = None, frozen: Frozen = NO_FROZEN,
                 pipeline: Optional[Pipeline] = None):
        cfg = plan.cfg
        self.pipeline = pipeline  # set: the schedule runs a step's micro-batches (pipeline.py)
        self.plan, self.cfg, self.env, self.model = plan, cfg, env, model
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.task, self.frozen = task, frozen  # frozen: models the loss runs, never trained
        self.val_ds = task.val_ds
        self.accum, self.global_batch = plan.accum, plan.global_batch
        self.steps_per_epoch, self.total_steps = plan.steps_per_epoch, plan.total_steps
        self.step = 0
        self.units = 0  # loss units trained on (tokens; texts or samples for other tasks)
        self.train_s = 0.0
        self.step_lr = 0.0  # the learning rate of the last optimizer step
        self.grads_bytes: Optional[int] = None  # measured once, while gradients exist
        self.data_wait_s = 0.0  # time the loop waited for batches: should be ~0
        self.progress = watchdog.Progress()  # where this rank is, for the stalled-rank watchdog
        self.activation_bytes: Optional[int] = None  # saved for backward by one micro-step
        # Wall time of every step, end to end (data, step, logging, bar): `paratrain bench`
        # takes the median after warm-up, which leaves start-up and compilation out.
        self.step_times: list[float] = []
        self.first_step_at = self.last_step_at = 0.0  # wall-clock ends of this run's steps
        self.step_cpu_times: list[float] = []  # CPU time of this process (all threads) per step
        # data parallelism splits the batch; the ranks of a tensor-parallel group read the same
        # samples, and only the first of them counts its sums (`counts_sums`)
        dims = plan.dims
        self.dp, self.data_rank, self.counts_sums = dims.dp, dims.data_rank(env.rank), \
            dims.counts(env.rank)
        self.sampler = GlobalSampler(len(task.train_ds), self.dp, self.data_rank,
                                     cfg.trainer.seed, shuffle=cfg.data.shuffle,
                                     drop_last=cfg.data.drop_last,
                                     global_batch=plan.global_batch)
        self.micro_batch = plan.micro_batch
        batches = StepBatches(self.sampler, self.micro_batch, self.accum)
        # checkpoint.record_samples: a pass-through that notes which samples each step took
        self.recorder = SampleRecorder(batches) if cfg.checkpoint.record_samples else None
        self.loader = step_loader(task.train_ds,
                                  batches if self.recorder is None else self.recorder,
                                  task.collate, cfg, env)
        self._stand_in: Any = None  # a batch run for an empty micro-batch (a short last step)
        self.snapshots = snapshots
        self.pending_loss = (0.0, 0.0)  # this rank's loss sum and units since the last log line
        self.last: dict = {}  # the last log line (a snapshot of the last step carries it)
        self.pending_counts: dict = {}  # and the task's training counts (`train_counts`)
        tr = cfg.trainer
        self.best = BestTracker(tr.early_stopping_patience, tr.early_stopping_threshold)
        self.on_best = on_best  # called (on every rank) after an evaluation that is the best
        self.stopped_early: Optional[str] = None  # why the loop stopped before total_steps
        self.stop = stop  # stop signals this process noted (preemption.py)
        self.stopped_by = 0  # the signal every rank agreed to stop on (0: none)
        self.val_metrics: dict = {}  # the last evaluation's figures besides the loss (accuracy)
        self.best_metrics: dict = {}  # those of the best evaluation (keep_best reports them)
        if resumed is not None:
            self._restore(resumed)

    def _restore(self, resumed: Resumed) -> None:
        """Continue after optimizer step `resumed.step`. The sampler skips what the steps of
        this epoch consumed, counted globally, so any world size continues the same order."""
        self.step = resumed.step
        epoch, done = divmod(self.step, self.steps_per_epoch)
        self.sampler.load_state_dict({"epoch": epoch, "seed": self.sampler.seed,
                                      "position": done * self.global_batch // self.dp})
        # the best evaluation so far is the same on every rank: any rank's copy will do
        self.best.load_state_dict((resumed.rank or resumed.loop["ranks"][0]).get("best", {}))
        self.last = dict((resumed.rank or resumed.loop["ranks"][0]).get("last") or {})
        if resumed.rank is not None:
            self.pending_loss = (resumed.rank["loss_sum"], resumed.rank["count"])
            self.pending_counts = dict(resumed.rank.get("counts", {}))
        elif self.env.is_master:  # another world size: the window's sums move to rank 0
            ranks = resumed.loop["ranks"]
            self.pending_loss = (sum(r["loss_sum"] for r in ranks),
                                 sum(r["count"] for r in ranks))
            self.pending_counts = _add_counts({}, *(r.get("counts", {}) for r in ranks))

    def rank_state(self, loss_sum: float = 0.0, count: float = 0.0,
                   counts: Optional[dict] = None) -> dict:
        """This rank's part of a snapshot (JSON): its loss sums and the task's training counts
        since the last log line (0 right after one), the best evaluation so far and the last log
        line."""
        return {"loss_sum": loss_sum, "count": count, "counts": counts or {},
                "best": self.best.state_dict(), "last": self.last}

    def record_evaluation(self, val_loss: Optional[float]) -> None:
        """Track the best validation loss; a new best goes to `on_best` (keep_best saves it)."""
        if not self.best.update(self.step, val_loss):
            return
        self.best_metrics = dict(self.val_metrics)
        if self.on_best is not None:
            self.on_best(self.step)

    def _micro_batches(self) -> Iterator[dict]:
        epoch = self.step // self.steps_per_epoch
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def run(self, records: Optional[loggers.RunRecords] = None) -> dict:
        cfg, env, tr = self.cfg, self.env, self.cfg.trainer
        mlog = MetricsLog(cfg.run_dir / "metrics.jsonl" if env.is_master else None, sinks=records)
        bar = ProgressBar(env, self.total_steps, self.step, tr.progress_bar)
        window = Throughput()
        loss_sum, count = self.pending_loss  # since the last log line, this rank
        counts = dict(self.pending_counts)
        slog = MetricsLog(cfg.run_dir / "samples.jsonl"
                                  if env.is_master and self.recorder is not None else None)
        last: dict = dict(self.last)
        batches = self._micro_batches()
        t0 = t_step = time.perf_counter()
        c_step = time.process_time()
        saved_at = self.step  # the resume point is a committed snapshot already
        try:
            while self.step < self.total_steps:
                if self._stop_agreed():  # a stop signal: snapshot after the step just done
                    bar.write(stop_line(self.stopped_by, self.step))
                    if self.snapshots is not None:
                        if saved_at != self.step:
                            self.snapshots.save(self.step, self.rank_state(loss_sum, count, counts),
                                                blocking=True)
                        self.snapshots.wait()  # committed before this rank leaves
                    break
                t_data = time.perf_counter()
                self.progress.at(self.step + 1, "data")
                micro = [next(batches) for _ in range(self.accum)]
                window.wait(time.perf_counter() - t_data)
                self.data_wait_s += time.perf_counter() - t_data
                s, n, grad_norm, step_units, step_counts = self._train_step(micro)
                loss_sum += s
                count += n
                counts = _add_counts(counts, step_counts)
                self.step += 1
                if self.recorder is not None:  # every rank's sample ids of this step
                    ids = env.gather_objects(self.recorder.pop() if self.counts_sums else [])
                    slog.write({"step": self.step, "ids": sorted(i for r in ids for i in r)})
                window.add(step_units)
                self.units += step_units
                evaluate = self.step % tr.eval_every == 0 and self.step < self.total_steps
                if self.step % tr.log_every == 0 or evaluate or self.step == self.total_steps:
                    loss = env.weighted_mean(loss_sum, count)
                    loss_sum = count = 0.0
                    last = {"step": self.step, "epoch": (self.step - 1) // self.steps_per_epoch,
                            "loss": loss, "lr": self.step_lr,
                            "grad_norm": grad_norm, **window.report()}
                    if counts:  # the same keys on every rank: summed like the loss
                        last.update(self.task.train_metrics(_sum_counts(env, counts)))
                        counts = {}
                    if evaluate:
                        last["val_loss"] = self.evaluate()
                        last.update(self.val_metrics)
                        self.record_evaluation(last["val_loss"])
                    mlog.write(last)
                    self.last = last
                    bar.update(0, loss=f"{loss:.3f}", lr=f"{last['lr']:.2e}")
                bar.update(1)
                if tr.verbose and self.step % self.steps_per_epoch == 0 \
                        and self.step < self.total_steps:  # the end of an epoch
                    bar.write("memory after epoch "
                              f"{self.step // self.steps_per_epoch}:\n" +
                              format_memory_table(gather_memory(
                                  env, self.model, self.optimizer, self.grads_bytes,
                                  self.activation_bytes)))
                if self.snapshots is not None and self.snapshots.should_save(self.step):
                    # this rank's loss sums since the last log line: the next logged loss
                    # comes out the same after a resume
                    self.snapshots.save(self.step, self.rank_state(loss_sum, count, counts))
                    saved_at = self.step
                now = time.perf_counter()
                self.step_times.append(now - t_step)
                self.last_step_at = time.time()
                self.first_step_at = self.first_step_at or self.last_step_at
                t_step, c_prev, c_step = now, c_step, time.process_time()
                self.step_cpu_times.append(c_step - c_prev)
                if self.best.should_stop:  # early stopping: the same step on every rank
                    self.stopped_early = self.best.why()
                    bar.write(f"early stopping at step {self.step}: {self.stopped_early}")
                    break
        finally:
            self.train_s += time.perf_counter() - t0
            bar.close()
            mlog.close()
            slog.close()
        return last

    def _stop_agreed(self) -> bool:
        """Whether any rank got a stop signal; every rank learns it at the same step boundary
        (one all-reduce of one number per step when distributed)."""
        if self.stop is None:
            return False
        self.stopped_by = int(self.env.max_over_ranks(self.stop.signum))
        return self.stopped_by != 0

    def _train_step(self, micro: list[Any]) -> tuple[float, float, float, float, dict]:
        """One optimizer step over `accum` micro-batches; returns this rank's (sum of losses,
        loss units), the global gradient norm before clipping, the loss units of the whole
        global batch, and this rank's sums of the task's training counts (`train_counts`)."""
        env, model = self.env, self.model
        per_sample = self.task.units_per_sample
        if per_sample is not None:  # every sample counts the same: no need to ask the others
            samples = self.sampler.samples_in_step(self.step % self.steps_per_epoch)
            global_units = float(samples * per_sample)
        else:  # padded rows: count the real tokens of the whole global batch first
            mine = sum(self.task.count_units(mb) for mb in micro if mb is not None) \
                if self.counts_sums else 0
            global_units = float(env.all_reduce_sum([mine])[0])
        # the data-parallel mean of the gradients undoes the `* dp`
        scale = self.dp / max(global_units, 1.0)
        if self.pipeline is not None:  # every micro-batch through this rank's stages
            self.progress.at(self.step + 1, "forward")
            loss_sum, units = self.pipeline.train_step(micro, scale)
            counts: dict = {}
        else:
            loss_sum, units, counts = self._accumulate(micro, scale)
        self.progress.at(self.step + 1, "optimizer")
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
        clip = self.cfg.optim.grad_clip or float("inf")
        if self.pipeline is not None:  # the norm of the whole model, over the stages
            norm = self.pipeline.clip_grad_norm_(clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.step_lr = self.scheduler.get_last_lr()[0]  # the lr this step used: the one logged
        self.scheduler.step()
        if self.grads_bytes is None:
            self.grads_bytes = local_bytes(p.grad for p in model.parameters())
        self.optimizer.zero_grad(set_to_none=True)
        if not self.counts_sums:  # a tensor-parallel peer or an earlier pipeline stage: the
            loss_sum, units, counts = torch.zeros(()), 0, dict.fromkeys(counts, 0.0)  # last
        return (float(loss_sum), float(units), float(norm), global_units,  # stage counts
                {k: float(v) for k, v in counts.items()})

    def _accumulate(self, micro: list[Any], scale: float) -> tuple[torch.Tensor, int, dict]:
        """Forward and backward of each micro-batch in turn, gradients synced on the last;
        this rank's (sum of losses, loss units, the task's counts)."""
        model, parallelism = self.model, self.plan.parallelism
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        units = 0
        counts: dict = {}
        for i, mb in enumerate(micro):
            sync = i == len(micro) - 1
            measure = self.activation_bytes is None and i == 0  # once: the first micro-step
            meter = SavedTensorMeter(model) if measure else contextlib.nullcontext()
            with (contextlib.nullcontext() if sync else parallelism.no_sync(model)), meter:
                self.progress.at(self.step + 1, "forward", i)
                if mb is None:  # no samples left for this rank in a short last step: a
                    s, n, c = self._loss(self._stand_in_batch())  # stand-in keeps the
                    s, n, mb_counts = s * 0.0, 0, dict.fromkeys(c, 0.0)  # collectives in step
                else:  # and adds nothing to the gradients or the counts
                    s, n, mb_counts = self._loss(mb)
                counts = _add_counts(counts, mb_counts)
                loss = s * scale
                if measure:
                    self.activation_bytes = meter.bytes
                self.progress.at(self.step + 1, "backward", i)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += s.detach().double()
            units += n
        return loss_sum, units, counts

    def _stand_in_batch(self) -> Any:
        """One training sample, collated: what a rank runs for an empty micro-batch."""
        if self._stand_in is None:
            self._stand_in = self.task.collate([self.task.train_ds[0]])
        return self._stand_in

    def _loss(self, mb: Any) -> tuple[torch.Tensor, int, dict]:
        """(sum of the loss, its loss units, the task's counts) for one micro-batch. A task may
        count more than the loss while training (`train_counts`, e.g. DPO's rewards): the loop
        sums those like the loss, and `train_metrics` turns the sums into logged figures."""
        dev = self.env.device
        amp = self.plan.parallelism.autocast(self.plan.precision, dev)
        counts = getattr(self.task, "train_counts", None)
        if counts is not None:
            return counts(self.model, mb, dev, amp, self.frozen)
        return (*self.task.loss(self.model, mb, dev, amp, self.frozen), {})

    def _eval_batch(self, mb: Any) -> tuple[Any, int, dict]:
        """(loss sum, loss units, counts) for one validation micro-batch. A task may count more
        than the loss (`eval_counts`, e.g. right predictions): evaluate sums those too."""
        dev = self.env.device
        amp = self.plan.parallelism.autocast(self.plan.precision, dev)
        counts = getattr(self.task, "eval_counts", None)
        if counts is None:
            return (*self.task.loss(self.model, mb, dev, amp, self.frozen), {})
        return counts(self.model, mb, dev, amp, self.frozen)

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        """Token-weighted validation loss over every sample once, whatever the world size; a
        task's extra counts (`eval_counts`) are summed the same way and turned into figures by
        its `eval_metrics` (kept in `val_metrics`)."""
        env, tr, collate = self.env, self.cfg.trainer, self.task.collate
        self.progress.at(self.step, "eval")
        n = len(self.val_ds) if self.val_ds is not None else 0
        if tr.eval_samples is not None:
            n = min(n, tr.eval_samples)
        if n == 0:
            return None
        mine = list(EvalSampler(n, self.dp, self.data_rank))
        b = self.micro_batch
        n_batches = math.ceil(math.ceil(n / self.dp) / b)  # the same on every rank
        was_training = self.model.training
        self.model.eval()
        if self.pipeline is not None:  # forward only through the stages; the last one sums
            total, count = self.pipeline.evaluate(
                [collate([self.val_ds[j] for j in mine[i * b:(i + 1) * b]])
                 if mine[i * b:(i + 1) * b] else None for i in range(n_batches)],
                b, self.cfg.data.seq_length)
            self.model.train(was_training)
            return env.weighted_mean(total, count)
        total = count = 0.0
        extra: dict = {}  # the task's counts, summed
        # a bar on rank 0 when validation lasts more than 2 s (the final one: ~20 s by default)
        bar = ProgressBar(env, n_batches, enabled=tr.progress_bar, desc="validation",
                          unit="batch", leave=False, delay_s=2.0)
        for i in range(n_batches):
            idx = mine[i * b:(i + 1) * b]
            if idx:
                s, c, counts = self._eval_batch(collate([self.val_ds[j] for j in idx]))
                for key, value in counts.items():
                    extra[key] = extra.get(key, 0.0) + (float(value) if self.counts_sums else 0.0)
            else:  # out of samples: keep step with the other ranks, count nothing
                _, _, counts = self._eval_batch(collate([self.val_ds[0]]))
                for key in counts:  # the same keys on every rank, for the sum below
                    extra.setdefault(key, 0.0)
                s, c = 0.0, 0
            if self.counts_sums:  # a tensor-parallel peer computed the same sums: counted once
                total += float(s)
                count += c
            bar.update(1)
        bar.close()
        self.model.train(was_training)
        if hasattr(self.task, "eval_metrics"):  # every rank ran >= 1 batch: the same keys
            keys = sorted(extra)
            summed = env.all_reduce_sum([extra[k] for k in keys] or [0.0]).tolist()
            self.val_metrics = self.task.eval_metrics(dict(zip(keys, summed)))
        return env.weighted_mean(total, count)


def _add_counts(total: dict, *more: dict) -> dict:
    """Counts (numbers, or 0-dim tensors kept on the device) summed key by key (a new dict)."""
    out = dict(total)
    for counts in more:
        for key, value in counts.items():
            out[key] = out.get(key, 0.0) + value
    return out


def _sum_counts(env: DistEnv, counts: dict) -> dict:
    """Counts summed over all ranks (every rank holds the same keys)."""
    keys = sorted(counts)
    return dict(zip(keys, env.all_reduce_sum([counts[k] for k in keys]).tolist()))
