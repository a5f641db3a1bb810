"""One rank's whole run: join the group, then three phases (`RankRun`): start (build the model
the plan says, resume), train (the loop), finish (evaluate, write the outputs); leave.
Everything this rank needs to know about the run comes in the plan; under torchrun / Slurm, where
no calling process planned it, the rank plans it here first (`plan_on_ranks`)."""

from __future__ import annotations

import math
import os
import shutil
import time
from typing import Any, Optional, Union

import torch
from torch import nn

from ..checkpoint.rundir import check_run_dir, prepare_run_dir
from ..checkpoint.snapshot_state import Resumed
from ..checkpoint.snapshotter import Snapshotter
from ..config.tree import TrainConfig
from ..dist import DistEnv
from ..fileio import atomic_write_json, replace_dir
from ..formatting import first_line
from ..launch import watchdog
from ..launch.preemption import StopSignals
from ..models import count_params
from ..models.files import MODEL_DIR
from ..parallel.memory import format_memory_table, gather_memory
from ..parallel.pipeline import Pipeline
from ..parallel.precision import prepare_model
from ..parallel.parallelize import parallelize, parallelize_frozen
from ..records import loggers
from ..records.console import log
from ..records.timeline import Timeline
from ..redact import redact_url
from ..runplan import RunPlan, auto_choice, make_plan, thread_share
from ..tasks.base import Task, TaskRecords, token_loss_sum
from . import optim
from .loop import TrainLoop
from .summary import run_summary
from .validation import bound_line

BEST_DIR = ".best"  # keep_best: the best evaluation's outputs until the run ends


def run_rank(cfg: TrainConfig, env: DistEnv, plan: Optional[RunPlan] = None,
             given: Union[Task, TaskRecords, None] = None,
             timeline: Optional[Timeline] = None) -> dict:
    """The run on this rank; {"summary", "run_dir", "is_master", "stopped_by"}. `plan` None:
    this rank was started by torchrun / Slurm, so it checks the run dir and plans for itself.
    `given`: what the Python API was handed (see `prepare_task`). A stop signal ends the run
    early with a committed snapshot and `stopped_by` set to the signal number. `timeline`: the
    launcher's start-up so far (None: this process is where the command started)."""
    run = RankRun(cfg, env, timeline or Timeline.of_this_process())
    run.timeline.mark("imports")
    _share_cores(env, plan)
    if plan is None and env.is_master:  # before init: nobody has written anything yet
        note = check_run_dir(cfg, env.attempt)
        if note:
            log(env, note)
    env.init()
    run.timeline.mark("init")
    # Names a stalled rank instead of a bare collective timeout; stacks go to the run dir.
    stall_watchdog = watchdog.Watchdog.start(env, cfg.run_dir, cfg.distributed.timeout_s)
    failed = False
    stop = StopSignals().install()  # noted from now on; the loop acts on it between steps
    try:
        run.start(plan, given, stop)
        stall_watchdog.watch(run.loop.progress, run.plan.parallelism.roles(env.world_size))
        last = run.train()
        if run.loop.stopped_by:  # a stop signal: the snapshot is committed; no evaluation
            return {"summary": {}, "run_dir": str(cfg.run_dir), "is_master": env.is_master,
                    "stopped_by": run.loop.stopped_by, "step": run.loop.state.step,
                    "signalled_here": bool(stop.signum)}  # or only another rank was
        return run.finish(last)
    except Exception as e:
        failed = True
        stalled = stall_watchdog.explain(e)  # a collective timed out: who stalled, and where
        if stalled is not None:
            raise stalled from e
        raise
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: leave without waiting for peers
        failed = True
        raise
    finally:
        stop.restore()
        stall_watchdog.stop()
        run.close()
        env.teardown(barrier=not failed)


def _share_cores(env: DistEnv, plan: Optional[RunPlan]) -> None:
    """Ranks sharing a machine's cores: one slice each, not all each. No plan yet (torchrun,
    Slurm, an elastic round): the share the plan will hold (`thread_share`: OMP_NUM_THREADS when
    set), not the cores alone: 2 threads per rank on a 2-core host that asked for 1 made every
    step of an elastic job spin in OpenMP, 5-50x the CPU of the planned run's steps."""
    from ..launch.environment import cpu_count
    if env.device.type == "cpu":
        threads = plan.cpu_threads if plan is not None else thread_share(
            cpu_count(), env.local_world_size, os.environ.get("OMP_NUM_THREADS"))["cpu_threads"]
        torch.set_num_threads(max(1, threads))


class RankRun:
    """One rank's run in the three phases `run_rank` calls in turn: `start` (build, resume),
    `train` (the loop), `finish` (evaluate, write the outputs). What `start` builds is held
    here, so the later phases share it and `close` drops every reference to the model before
    the process group goes (a live DDP module at teardown can abort)."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, timeline: Timeline):
        self.cfg, self.env, self.timeline = cfg, env, timeline
        self.t_start = time.perf_counter()
        # set by `start`: the task and plan, what _build made, the snapshot resumed from and
        # the world history; the loop. `train` opens the sinks (`records`).
        self.task: Task
        self.plan: RunPlan
        self.model: Any = None
        self.optimizer: Any = None
        self.n_params = 0
        self.frozen: dict[str, nn.Module] = {}
        self.snapshots: Optional[Snapshotter] = None
        self.resumed: Optional[Resumed] = None
        self.world_history: list = []
        self.loop: Optional[TrainLoop] = None
        self.records: Optional[loggers.RunRecords] = None

    def start(self, plan: Optional[RunPlan], given: Union[Task, TaskRecords, None],
              stop: StopSignals) -> None:
        """Everything before the first step, in the order each part needs the one before: the
        task, the plan (torchrun / Slurm), the model and optimizer, the snapshot to resume
        from (which decides the run dir's fate and the world history), the start lines, and
        the loop, positioned at the resumed step."""
        cfg, env = self.cfg, self.env
        # the calling process, when there is one, already logged what preparing the data found
        task = prepare_task(cfg, env, given, quiet=plan is not None)
        if plan is None:
            plan = plan_on_ranks(cfg, env, task)
        self.task, self.plan = task, plan
        self.timeline.mark("data")
        self.model, self.optimizer, scheduler, scaler, self.n_params, self.frozen, pipeline = \
            _build(plan, env, task)
        self.snapshots = Snapshotter(plan, env, self.model, self.optimizer, scheduler, scaler,
                                     model_info=task.model_info,
                                     tokenizer_path=task.tokenizer_path)
        self.resumed = resumed = self.snapshots.resume()
        self.world_history = _world_history(cfg, env, resumed)
        self.snapshots.info["world_history"] = self.world_history
        if env.is_master:
            prepare_run_dir(cfg, None if resumed is None else resumed.step)
        self.timeline.mark("model")
        _log_start(plan, env, task, self.n_params, resumed)
        if cfg.trainer.verbose:
            log(env, "memory at start:\n" + format_memory_table(gather_memory(
                env, self.model, self.optimizer, frozen=list(self.frozen.values()))))
        self.loop = TrainLoop(plan, env, self.model, self.optimizer, scheduler, scaler, task,
                              frozen=self.frozen, snapshots=self.snapshots, resumed=resumed,
                              on_best=self._save_best if cfg.trainer.keep_best else None,
                              stop=stop, pipeline=pipeline)

    def _save_best(self, step: int) -> None:
        """keep_best: a new best evaluation's weights, until the run ends (collective: every
        rank gathers, rank 0 writes)."""
        state = self.plan.parallelism.full_state_dict(self.model, self.env)
        if self.env.is_master:
            self.task.save(self.plan.parallelism.unwrap(self.model),
                           self.cfg.run_dir / BEST_DIR / MODEL_DIR, state)

    def train(self) -> dict:
        """The steps, with the run's sinks (TensorBoard, ...) open; the last log line. Its own
        phase because a stop signal ends the run here, with a snapshot and nothing more."""
        loop = self.loop
        self.records = loggers.RunRecords.open(self.cfg, self.env, start_step=loop.state.step)
        self.timeline.mark("records")
        last = loop.run(self.records)
        if loop.figures.first_step_at:
            self.timeline.mark("first_step", loop.figures.first_step_at)
            self.timeline.mark("last_step", loop.figures.last_step_at)
        return last

    def finish(self, last: dict) -> dict:
        """After the last step: the final evaluation, the weights to keep, summary.json and the
        outputs written by rank 0. Nobody leaves before rank 0 has written them; if it could
        not, a snapshot of the last step (every rank) lets the same command write them without
        training again."""
        cfg, env, plan, loop = self.cfg, self.env, self.plan, self.loop
        self.snapshots.wait()  # the last snapshot in flight is committed before anything else
        val_loss, val_metrics, keep_best = self._final_evaluation()
        memory = gather_memory(env, self.model, self.optimizer, loop.figures.grads_bytes,
                               loop.figures.activation_bytes, list(self.frozen.values()))
        if cfg.trainer.verbose:
            log(env, "memory at end:\n" + format_memory_table(memory))
        state = None if keep_best else plan.parallelism.full_state_dict(self.model, env)
        summary = run_summary(self, last, val_loss, memory, time.perf_counter() - self.t_start)
        summary.update(val_metrics)
        summary.update(startup_s=self.timeline.phases(upto="first_step"),
                       timeline={"start": self.timeline.start, **self.timeline.marks})
        # why rank 0 could not write the outputs (disk full, ...)
        unwritten = self._write_outputs(summary, state, keep_best) if env.is_master else None
        unwritten = env.broadcast_object(unwritten)
        if unwritten:
            raise self.snapshots.outputs_failed(loop.state.step, loop.state.to_snapshot(),
                                                f"{cfg.run_dir / MODEL_DIR} ({unwritten})")
        return {"summary": summary, "run_dir": str(cfg.run_dir), "is_master": env.is_master,
                "stopped_by": 0}

    def _final_evaluation(self) -> tuple[Optional[float], dict, bool]:
        """(validation loss, the task's figures, whether the outputs are keep_best's earlier
        weights rather than the last step's)."""
        loop, env = self.loop, self.env
        if self.cfg.trainer.eval_every == 0:  # evaluation off (keep_best is refused with it)
            return None, {}, False
        val_loss = loop.evaluate()
        val_metrics = loop.val_metrics  # e.g. accuracy, for a classifier
        best = loop.state.best
        final_is_best = best.update(loop.state.step, val_loss, val_metrics)
        keep_best = self.cfg.trainer.keep_best and not final_is_best and best.best_step is not None
        if keep_best:
            log(env, f"keeping the weights of step {best.best_step} (validation loss "
                     f"{best.best_loss:.4f}; the last step's is {val_loss:.4f})")
            val_loss, val_metrics = best.best_loss, best.best_metrics
        if val_metrics.get("val_reward") is not None:  # online RL: the loss is -reward
            log(env, f"validation reward {val_metrics['val_reward']:.4f} (the held-out "
                     "prompts' completions, scored)")
        elif val_loss is not None:
            log(env, f"validation loss {val_loss:.4f}" + (
                f" (perplexity {math.exp(val_loss):.2f})" if self.task.perplexity else "") + (
                f"; accuracy {val_metrics['val_accuracy']:.4f} on {val_metrics['val_samples']} "
                f"{self.task.unit_name}" if val_metrics.get("val_accuracy") is not None else ""))
        return val_loss, val_metrics, keep_best

    def _write_outputs(self, summary: dict, state: Optional[dict], keep_best: bool
                       ) -> Optional[str]:
        """Rank 0: model/ (keep_best: the best evaluation's, saved when it happened), then
        summary.json last (the run is finished); None, or why they could not be written."""
        cfg, best_dir = self.cfg, self.cfg.run_dir / BEST_DIR
        try:
            if keep_best:
                for name in [p.name for p in best_dir.iterdir()]:  # model/ (and adapter/)
                    replace_dir(best_dir / name, cfg.run_dir / name)
            else:
                self.task.save(self.plan.parallelism.unwrap(self.model), cfg.run_dir / MODEL_DIR,
                               state)
            shutil.rmtree(best_dir, ignore_errors=True)
            atomic_write_json(cfg.run_dir / "summary.json", summary)  # finished: last
        except Exception as e:  # OSError, or a writer's own (safetensors: SafetensorError)
            return f"{type(e).__name__}: {first_line(e)}"
        self.records.finish(summary)  # memory per rank to the sinks; report.png
        loss = summary["final_loss"]  # None: no step logged (resumed at the end)
        log(self.env, f"done in {time.time() - self.timeline.start:.1f} s from the command's "
                      f"start ({summary['wall_s']:.1f} s training): " + (
            f"final loss {loss:.4f}; " if loss is not None else "") + (
            f"final reward {summary['final_reward']:.4f}; "
            if summary.get("final_reward") is not None else "") +
            f"outputs in {cfg.run_dir}")
        return None

    def close(self) -> None:
        """The sinks closed, and every reference to the model dropped."""
        if self.records is not None:
            self.records.close()
        self.model = self.optimizer = self.snapshots = self.loop = self.records = None
        self.frozen = {}


def _world_history(cfg: TrainConfig, env: DistEnv, resumed: Optional[Resumed]) -> list:
    """[[step, world size], ...] from the first step on: the snapshot's, and this start's when
    the world size changed (an elastic run logs the membership change)."""
    history = list(resumed.loop.get("world_history", [[0, resumed.world_size]])) \
        if resumed is not None else []
    if not history or history[-1][1] != env.world_size:
        history.append([resumed.step if resumed else 0, env.world_size])
        if resumed is not None and cfg.distributed.elastic:  # a membership change
            change = "a node left" if env.world_size < resumed.world_size else "a node joined"
            log(env, f"world size {resumed.world_size} -> {env.world_size} at step "
                     f"{resumed.step} ({change}); resharded")
    return history


def prepare_task(cfg: TrainConfig, env: DistEnv,
                 given: Union[Task, TaskRecords, None] = None, quiet: bool = False) -> Task:
    """What is trained: a task already prepared (the user's own model and data, a Task object
    handed to the API, or one this process built), else the registered task of data.format,
    prepared from the config (and the Python API's records, when `given` holds them)."""
    say = (lambda m: None) if quiet else (lambda m: log(env, m))
    if given is not None and not isinstance(given, TaskRecords):
        return given
    return cfg.task_spec.load().prepare(cfg, env, given, say)


def plan_on_ranks(cfg: TrainConfig, env: DistEnv, task: Task) -> RunPlan:
    """Under torchrun / Slurm: every rank builds the same plan; `auto`'s pick is rank 0's."""
    choice = None
    if env.is_master:
        choice = auto_choice(cfg, task, world_size=env.world_size, device=env.device,
                             local_world_size=env.local_world_size)
    choice = env.broadcast_object(choice)
    devices = [env.device] * env.local_world_size  # this rank reads only its own
    return make_plan(cfg, task, devices=devices, world_size=env.world_size,
                     local_world_size=env.local_world_size, choice=choice)


def _build(plan: RunPlan, env: DistEnv, task: Task
           ) -> tuple[Any, Any, Any, Any, int, dict[str, nn.Module], Optional[Pipeline]]:
    """(wrapped model, optimizer, LR scheduler, gradient scaler, parameter count, the task's
    frozen models placed and sharded like the model: outside the optimizer and snapshots, and
    the pipeline when there is one: the model is then this rank's part of it)."""
    tr = plan.cfg.trainer
    torch.manual_seed(tr.seed)  # the same initial weights on every rank
    model = prepare_model(task.build_model(), plan.precision)
    n_params = count_params(model)
    pipeline = None
    if plan.dims.pp > 1:  # this rank's stages, and the schedule that runs them
        pipeline = Pipeline(plan.parallelism, model, env, micro_batches=plan.accum,
                            precision=plan.precision, label_smoothing=tr.label_smoothing,
                            loss_sum=token_loss_sum,
                            activation_checkpointing=plan.activation_checkpointing,
                            compile=tr.compile)
        model = pipeline.model
    else:
        model = parallelize(model, plan.parallelism, env, precision=plan.precision,
                            activation_checkpointing=plan.activation_checkpointing,
                            compile=tr.compile, wrap=task.fsdp_wrap, dims=plan.dims)
    frozen = {name: parallelize_frozen(prepare_model(m, plan.precision), plan.parallelism, env,
                                       precision=plan.precision, wrap=task.fsdp_wrap,
                                       dims=plan.dims)
              for name, m in task.build_frozen().items()}
    torch.manual_seed(tr.seed + 1 + env.rank)  # dropout differs between ranks
    optimizer = optim.build_optimizer(model, plan.cfg.optim, env.device)
    scheduler = optim.build_scheduler(optimizer, plan.cfg.optim, plan.total_steps)
    scaler = plan.parallelism.grad_scaler(plan.precision, env.device)
    return model, optimizer, scheduler, scaler, n_params, frozen, pipeline


def _log_start(plan: RunPlan, env: DistEnv, task: Task, n_params: int,
               resumed: Optional[Resumed]) -> None:
    tr = plan.cfg.trainer
    extras = "".join([" + activation checkpointing" if plan.activation_checkpointing else "",
                      " + CPU offload" if plan.parallelism.offloads_to_host else ""])
    threads = (f" ({plan.cpu_threads} thread{'s' if plan.cpu_threads > 1 else ''} each, "
               f"{'from OMP_NUM_THREADS' if plan.threads_from != 'cores' else 'a share of the cores'})"
               if env.device.type == "cpu" else "")
    log(env, f"{task.describe(n_params)}; strategy {plan.strategy}{extras} "
             f"({plan.parallelism_reason}); {env.world_size} worker(s) on {env.device.type}"
             f"{threads}; precision {plan.precision}")
    dims = plan.dims
    split = f"{env.world_size} workers" if dims.tp == 1 and dims.pp == 1 and dims.cp == 1 else \
        f"{dims.dp} data-parallel group{'s' if dims.dp > 1 else ''} of {dims.cp * dims.tp} " \
        f"workers (context {dims.cp} x tensor {dims.tp})" if dims.pp == 1 and dims.cp > 1 else \
        f"{dims.dp} data-parallel group{'s' if dims.dp > 1 else ''} of {dims.tp} " \
        "tensor-parallel workers" if dims.pp == 1 else \
        f"{dims.dp} data-parallel worker{'s' if dims.dp > 1 else ''} per stage of a " \
        f"{dims.pp}-stage pipeline"
    repeat, per_epoch = plan.steps_per_batch, f"({plan.steps_per_epoch} per epoch)"
    decided = ("by trainer.max_steps, trainer.epochs counts only when it is null"
               if tr.max_steps else f"by trainer.epochs={tr.epochs}")
    steps = (f"{plan.total_steps} steps = {-(-plan.total_steps // repeat)} rollouts x {repeat} "
             f"iterations each {per_epoch}, {decided}" if repeat > 1 else
             f"{plan.total_steps} steps {decided} {per_epoch}")
    log(env, f"batch: {tr.batch_size} per device x {split} x {plan.accum} "
             f"accumulation = {plan.global_batch} {task.sample_name}; {steps}")
    for line in [*optim.schedule_warnings(plan.cfg.optim, plan.total_steps),
                 bound_line(plan, task)]:
        if line:
            log(env, line)
    if resumed is not None:
        resharded = (f"; saved by {resumed.world_size} worker(s), resharded to "
                     f"{env.world_size}" if resumed.world_size != env.world_size else "")
        log(env, f"resumed from step {resumed.step} ({redact_url(resumed.url)}){resharded}")
        if resumed.step >= plan.total_steps:
            log(env, past_the_end(resumed.step, plan.total_steps, tr.max_steps))


def past_the_end(step: int, total: int, max_steps: int) -> str:
    """The line of a run resumed at or past its last step: it trains nothing, and says why."""
    limit = f"trainer.max_steps={max_steps}" if max_steps else "trainer.epochs"
    return (f"nothing to train: the snapshot is at step {step} and this run ends at step "
            f"{total} ({limit}); raise {limit.split('=')[0]} to train on, or start a new run "
            "(another run.name)")
