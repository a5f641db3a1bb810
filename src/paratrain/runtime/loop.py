"""The training loop of one rank: the nanoGPT loop, made exact across world sizes.

- Every global batch is the same set of samples whatever the world size (GlobalSampler).
- The loss is a token-weighted mean over all ranks and micro-steps: each micro-step backpropagates
  sum(token losses) * dp / (tokens in the global batch), and the data-parallel gradient mean
  over the dp ranks undoes the `* dp`, so the gradient does not depend on how the batch was split.
  (dp is the world size unless tensor parallelism makes groups of ranks share one batch: then
  the plan's ParallelDims says which slice a rank reads and whether its sums count.)
- Validation visits every sample exactly once, and every rank runs the same number of batches
  (a rank out of samples runs a dummy batch that counts nothing), so wrappers that communicate in
  forward (FSDP) never wait on a rank that has stopped (validation.py).
What is trained (model, data, loss) comes in as a task (task.py); how it is spread over devices,
the batch plan and the number of steps come in as the run plan (runplan.py), decided before the
workers started: the loop derives none of them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from torch import nn

from ..checkpoint.snapshot_state import Resumed
from ..checkpoint.snapshotter import Snapshotter
from ..data.sampler import GlobalSampler, SampleRecorder, StepBatches
from ..dist import DistEnv
from ..launch import watchdog
from ..launch.preemption import StopSignals, stop_line
from ..parallel.context import context_split
from ..parallel.memory import SavedTensorMeter, format_memory_table, gather_memory, local_bytes
from ..parallel.pipeline import Pipeline
from ..records import loggers
from ..records.console import ProgressBar
from ..records.metrics import MetricsLog, Throughput
from ..runplan import RunPlan
from ..tasks.base import NO_FROZEN, Frozen, Task
from .early_stop import BestTracker
from .host_group import HostGroup
from .loader import step_loader
from .loop_state import LoopFigures, LoopState, add_counts, read_norm, unread
from .validation import Validation


class TrainLoop:
    """The training loop of one rank. What it carries from step to step is `state` (a
    LoopState: what a snapshot saves); what it measures is `figures`; the rest is what it was
    given, or derived from the plan once."""

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
        self.snapshots = snapshots
        self.on_best = on_best  # called (on every rank) after an evaluation that is the best
        self.stop = stop  # stop signals this process noted (preemption.py)
        tr = cfg.trainer
        self.state = LoopState(best=BestTracker(tr.early_stopping_patience,
                                                tr.early_stopping_threshold))
        self.figures = LoopFigures()
        self.progress = watchdog.Progress()  # where this rank is, for the stalled-rank watchdog
        self.host = HostGroup(env)  # the per-step stop check and unit count, off the device
        self.validation = Validation(plan, env, model, task, frozen, pipeline, self.progress)
        # data parallelism splits the batch; the ranks of a tensor-parallel group read the same
        # samples, and only the first of them counts its sums (`counts_sums`)
        dims = plan.dims
        self.dp, self.data_rank, self.counts_sums = dims.dp, dims.data_rank(env.rank), \
            dims.reports_sums(env.rank)
        # context parallelism: the ranks of a CP group read the same samples, each its chunks
        self.split = context_split(dims, env.rank)
        self.sampler = GlobalSampler(len(task.train_ds), self.dp, self.data_rank,
                                     tr.seed, shuffle=cfg.data.shuffle,
                                     drop_last=cfg.data.drop_last,
                                     global_batch=plan.global_batch,
                                     lengths=task.sample_lengths()
                                     if cfg.data.group_by_length else None)
        batches = StepBatches(self.sampler, plan.micro_batch, plan.accum)
        # checkpoint.record_samples: a pass-through that notes which samples each step took
        self.recorder = SampleRecorder(batches) if cfg.checkpoint.record_samples else None
        self.loader = step_loader(task.train_ds,
                                  batches if self.recorder is None else self.recorder,
                                  task.collate, cfg, env)
        self._stand_in: Any = None  # a batch run for an empty micro-batch (a short last step)
        self._held: Optional[list] = None  # the step's micro-batches (steps_per_batch > 1)
        self.stopped_early: Optional[str] = None  # why the loop stopped before total_steps
        self.stopped_by = 0  # the signal every rank agreed to stop on (0: none)
        self.val_metrics: dict = {}  # the last evaluation's figures besides the loss (accuracy)
        if resumed is not None:
            self._restore(resumed)

    def _restore(self, resumed: Resumed) -> None:
        """Continue after optimizer step `resumed.step`. The sampler skips what the steps of
        this epoch consumed, counted globally, so any world size continues the same order."""
        self.state.restore(resumed, self.env.is_master)
        epoch, done = divmod(self.state.step, self.plan.steps_per_epoch)
        batches_done = done // self.plan.steps_per_batch  # (rl.num_iterations: whole batches)
        self.sampler.load_state_dict({"epoch": epoch, "seed": self.sampler.seed,
                                      "position": batches_done * self.plan.global_batch //
                                      self.dp})

    def record_evaluation(self, val_loss: Optional[float]) -> None:
        """Track the best validation loss; a new best goes to `on_best` (keep_best saves it)."""
        if not self.state.best.update(self.state.step, val_loss, self.val_metrics):
            return
        if self.on_best is not None:
            self.on_best(self.state.step)

    def _micro_batches(self) -> Iterator[dict]:
        epoch = self.state.step // self.plan.steps_per_epoch
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def run(self, records: Optional[loggers.RunRecords] = None) -> dict:
        """Train from `state.step` to the plan's last step, or until a stop signal (a snapshot
        of the step just done, then out) or early stopping; returns the last log line."""
        st, total = self.state, self.plan.total_steps
        out = _Outputs.open(self, records)
        batches = self._micro_batches()
        t0 = time.perf_counter()
        clock = _StepClock(t0)
        saved_at = st.step  # the resume point is a committed snapshot already
        try:
            while st.step < total:
                if self._stop_agreed():  # a stop signal: snapshot after the step just done
                    out.bar.write(stop_line(self.stopped_by, st.step))
                    self._last_snapshot(saved_at)
                    break
                result = self._step(batches, out)
                every = self.cfg.trainer.eval_every  # 0: evaluation off
                evaluate = every > 0 and st.step % every == 0 and st.step < total
                if st.step % self.cfg.trainer.log_every == 0 or evaluate or st.step == total:
                    self._log(result, evaluate, out)
                out.bar.update(1)
                self._epoch_memory(out.bar)
                if self.snapshots is not None and self.snapshots.should_save(st.step):
                    self.snapshots.save(st.step, st.to_snapshot())
                    saved_at = st.step
                clock.tick(self.figures)
                if st.best.should_stop:  # early stopping: the same step on every rank
                    self.stopped_early = st.best.why()
                    out.bar.write(f"early stopping at step {st.step}: {self.stopped_early}")
                    break
            self.host.drain()  # the stop check started during the last step
        finally:
            self.figures.train_s += time.perf_counter() - t0
            out.close()
        return st.last

    def _step(self, batches: Iterator[dict], out: _Outputs) -> StepResult:
        """Read a step's micro-batches, train on them, add this rank's sums to the window."""
        st = self.state
        t_data = time.perf_counter()
        self.progress.at(st.step + 1, "data")
        if st.step % self.plan.steps_per_batch == 0 or self._held is None:  # else the batch
            self._held = [next(batches) for _ in range(self.plan.accum)]  # is trained again
        micro = self._held
        out.window.wait(time.perf_counter() - t_data)
        self.figures.data_wait_s += time.perf_counter() - t_data
        micro, rolled = self._rollout(micro)
        t_learn = time.perf_counter()
        result = self._train_step(micro)
        if rolled:  # online RL: the step's time split into generation, scoring and learning
            rolled["learning_s"] = time.perf_counter() - t_learn
        st.loss_sum = st.loss_sum + result.loss_sum  # (a device tensor: read at log steps)
        st.count = st.count + result.units
        st.counts = add_counts(st.counts, {**result.counts, **rolled})
        st.step += 1
        if self.recorder is not None:  # every rank's sample ids of this step
            first = self.counts_sums and (self.split is None or self.split.rank == 0)  # one
            ids = self.env.gather_objects(self.recorder.pop() if first else [])  # per CP group
            out.samples.write({"step": st.step, "ids": sorted(i for r in ids for i in r)})
        out.window.add(result.global_units)
        self.figures.units += result.global_units
        return result

    def _rollout(self, micro: list[Any]) -> tuple[list[Any], dict]:
        """A task that learns from its own samples (online RL, tasks/rl/grpo.py) turns the step's
        prompts into scored completions first (`rollout`), with figures summed like `counts`;
        any other task's `rollout` gives the micro-batches back as they are."""
        self.progress.at(self.state.step + 1, "rollout")
        amp = self.plan.parallelism.autocast(self.plan.precision, self.env.device)
        return self.task.rollout(self.model, micro, self.state.step, self.env, amp, self.frozen)

    def _log(self, result: StepResult, evaluate: bool, out: _Outputs) -> None:
        """A log line: the window's loss over every rank (and the task's training figures),
        the validation loss when `evaluate`; written to metrics.jsonl and the sinks."""
        st, env = self.state, self.env
        loss = env.weighted_mean(float(st.loss_sum), float(st.count))  # the step's host syncs
        st.loss_sum = st.count = 0.0
        last = {"step": st.step, "epoch": (st.step - 1) // self.plan.steps_per_epoch,
                "loss": loss, "lr": result.lr, "grad_norm": read_norm(result.grad_norm),
                **out.window.report()}
        if st.counts:  # the same keys on every rank: summed like the loss
            last.update(self.task.train_metrics(_sum_counts(env, st.counts)))
            st.counts = {}
        if evaluate:
            last["val_loss"] = self.evaluate()
            last.update(self.val_metrics)
            self.record_evaluation(last["val_loss"])
        out.metrics.write(last)
        st.last = last
        shown = {k.rpartition("/")[2]: f"{last[k]:.3g}"  # the task's own (online RL: reward
                 for k in self.task.progress_keys if k in last}  # and times)
        out.bar.update(0, loss=f"{loss:.3f}", lr=f"{last['lr']:.2e}", **shown)

    def _epoch_memory(self, bar: ProgressBar) -> None:
        """trainer.verbose: the memory table at the end of each epoch but the last."""
        step, per_epoch = self.state.step, self.plan.steps_per_epoch
        if self.cfg.trainer.verbose and step % per_epoch == 0 and step < self.plan.total_steps:
            bar.write(f"memory after epoch {step // per_epoch}:\n" + format_memory_table(
                gather_memory(self.env, self.model, self.optimizer, self.figures.grads_bytes,
                              self.figures.activation_bytes)))

    def _last_snapshot(self, saved_at: int) -> None:
        """A stop signal: a snapshot of the step just done (unless the last one is of it),
        committed before this rank leaves."""
        if self.snapshots is None:
            return
        if saved_at != self.state.step:
            self.snapshots.save(self.state.step, self.state.to_snapshot(), blocking=True)
        self.snapshots.wait()

    def _stop_agreed(self) -> bool:
        """Whether any rank got a stop signal; every rank learns it at the same step boundary
        (one all-reduce of one number per step when distributed, on the host group and
        overlapped with the step: host_group.py)."""
        if self.stop is None:
            return False
        self.stopped_by = self.host.stop_agreed(self.stop.signum)
        return self.stopped_by != 0

    def _train_step(self, micro: list[Any]) -> StepResult:
        """One optimizer step over `accum` micro-batches."""
        model, step = self.model, self.state.step
        per_sample = self.task.units_per_sample
        if per_sample is not None:  # every sample counts the same: no need to ask the others
            samples = self.sampler.samples_in_step(
                step % self.plan.steps_per_epoch // self.plan.steps_per_batch)
            global_units = float(samples * per_sample)
        else:  # padded rows: count the real tokens of the whole global batch first
            mine = sum(self.task.count_units(mb) for mb in micro if mb is not None) \
                if self.counts_sums else 0
            global_units = self.host.sum([mine])[0]
        # the data-parallel mean of the gradients (over dp x cp ranks) undoes the `* dp_cp`
        scale = self.plan.dims.dp_cp / max(global_units, 1.0)
        if self.pipeline is not None:  # every micro-batch through this rank's stages
            self.progress.at(step + 1, "forward")
            loss_sum, units = self.pipeline.train_step(micro, scale)
            counts: dict = {}
        else:
            loss_sum, units, counts = self._accumulate(micro, scale)
        self.progress.at(step + 1, "optimizer")
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
        clip = self.cfg.optim.grad_clip or float("inf")
        if self.pipeline is not None:  # the norm of the whole model, over the stages
            norm = self.pipeline.clip_grad_norm_(clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]  # the lr this step used: the one logged
        self.scheduler.step()
        if self.figures.grads_bytes is None:
            self.figures.grads_bytes = local_bytes(p.grad for p in model.parameters())
        self.optimizer.zero_grad(set_to_none=True)
        if not self.counts_sums:  # a tensor-parallel peer or an earlier pipeline stage: the
            loss_sum, units, counts = 0.0, 0, dict.fromkeys(counts, 0.0)  # last stage counts
        # the sums and the norm stay where they are (on a GPU: reading them is a host sync);
        # the loop reads them at log steps only
        return StepResult(unread(loss_sum), unread(units), norm.detach(), lr, global_units,
                          {k: unread(v) for k, v in counts.items()})

    def _accumulate(self, micro: list[Any], scale: float) -> tuple[torch.Tensor, int, dict]:
        """Forward and backward of each micro-batch in turn, gradients synced on the last;
        this rank's (sum of losses, loss units, the task's counts)."""
        model, parallelism = self.model, self.plan.parallelism
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        units = 0
        counts: dict = {}
        for i, mb in enumerate(micro):
            sync = i == len(micro) - 1
            measure = self.figures.activation_bytes is None and i == 0  # once: the first micro-step
            meter = SavedTensorMeter(model) if measure else contextlib.nullcontext()
            with (contextlib.nullcontext() if sync else parallelism.no_sync(model)), meter:
                self.progress.at(self.state.step + 1, "forward", i)
                if mb is None:  # no samples left for this rank in a short last step: a
                    s, n, c = self._loss(self._stand_in_batch())  # stand-in keeps the
                    s, n, mb_counts = s * 0.0, 0, dict.fromkeys(c, 0.0)  # collectives in step
                else:  # and adds nothing to the gradients or the counts
                    s, n, mb_counts = self._loss(mb)
                counts = add_counts(counts, mb_counts)
                loss = s * scale
                if measure:
                    self.figures.activation_bytes = meter.bytes
                self.progress.at(self.state.step + 1, "backward", i)
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
        mb = self.split.batch(mb) if self.split is not None else mb  # this rank's chunks
        return self.task.train_counts(self.model, mb, dev, amp, self.frozen)

    def evaluate(self) -> Optional[float]:
        """The validation loss at this step (exact: runtime/validation.py); the task's other
        figures (`eval_metrics`, e.g. accuracy) go to `val_metrics`."""
        val_loss, metrics = self.validation.run(self.state.step)
        if metrics is not None:
            self.val_metrics = metrics
        return val_loss


def _sum_counts(env: DistEnv, counts: dict) -> dict:
    """Counts summed over all ranks (every rank holds the same keys)."""
    keys = sorted(counts)
    return dict(zip(keys, env.all_reduce_sum([float(counts[k]) for k in keys]).tolist()))


class StepResult(NamedTuple):
    """One optimizer step, as the loop logs it."""
    # float64 0-dim tensors on the device or floats, not read until a log step
    loss_sum: Any  # this rank's sum of losses (0 on a rank whose sums do not count)
    units: Any  # and its loss units
    grad_norm: torch.Tensor  # the global gradient norm, before clipping (a DTensor if sharded)
    lr: float  # the learning rate the step used
    global_units: float  # the loss units of the whole global batch
    counts: dict  # this rank's sums of the task's training counts (`train_counts`), as loss_sum


@dataclass
class _Outputs:
    """Where one `run` writes: metrics.jsonl (and the sinks), samples.jsonl
    (checkpoint.record_samples), the progress bar, and the throughput of the log window."""
    metrics: MetricsLog
    samples: MetricsLog
    bar: ProgressBar
    window: Throughput

    @classmethod
    def open(cls, loop: TrainLoop, records: Optional[loggers.RunRecords]) -> _Outputs:
        cfg, env = loop.cfg, loop.env
        return cls(MetricsLog(cfg.run_dir / "metrics.jsonl" if env.is_master else None,
                              sinks=records),
                   MetricsLog(cfg.run_dir / "samples.jsonl"
                              if env.is_master and loop.recorder is not None else None),
                   ProgressBar(env, loop.plan.total_steps, loop.state.step,
                               cfg.trainer.progress_bar),
                   Throughput())

    def close(self) -> None:
        self.bar.close()
        self.metrics.close()
        self.samples.close()


class _StepClock:
    """Each step's wall time, end to end, and this process's CPU time during it."""

    def __init__(self, start: float):
        self.wall, self.cpu = start, time.process_time()

    def tick(self, figures: LoopFigures) -> None:
        now = time.perf_counter()
        figures.step_times.append(now - self.wall)
        figures.last_step_at = time.time()
        figures.first_step_at = figures.first_step_at or figures.last_step_at
        cpu = time.process_time()
        figures.step_cpu_times.append(cpu - self.cpu)
        self.wall, self.cpu = now, cpu
