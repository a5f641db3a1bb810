"""One rank's whole run: join the group, build the model the plan says, resume, loop, evaluate,
save, leave. Everything this rank needs to know about the run comes in the plan; under torchrun /
Slurm, where no calling process planned it, the rank plans it here first (`plan_on_ranks`)."""

from __future__ import annotations

import math
import shutil
import time
from typing import Any, Optional, Union

import torch
from torch import nn

from ..checkpoint.rundir import check_run_dir, prepare_run_dir
from ..checkpoint.snapshotter import Resumed, Snapshotter
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
from ..parallel.strategies import parallelize, parallelize_frozen
from ..records import loggers
from ..records.console import log
from ..records.timeline import Timeline
from ..redact import redact_url
from ..runplan import RunPlan, auto_choice, make_plan
from ..tasks.base import Task, TaskRecords, token_loss_sum
from . import optim
from .loop import TrainLoop

BEST_DIR = ".best"  # keep_best: the best evaluation's outputs until the run ends


def run_rank(cfg: TrainConfig, env: DistEnv, plan: Optional[RunPlan] = None,
             given: Union[Task, TaskRecords, None] = None,
             timeline: Optional[Timeline] = None) -> dict:
    """The run on this rank; {"summary", "run_dir", "is_master", "stopped_by"}. `plan` None:
    this rank was started by torchrun / Slurm, so it checks the run dir and plans for itself.
    `given`: what the Python API was handed (see `prepare_task`). A stop signal ends the run
    early with a committed snapshot and `stopped_by` set to the signal number. `timeline`: the
    launcher's start-up so far (None: this process is where the command started)."""
    from ..launch.environment import cpu_count
    t_start = time.perf_counter()
    timeline = timeline or Timeline.of_this_process()
    timeline.mark("imports")
    if env.device.type == "cpu":  # ranks sharing the cores: one slice each, not all each
        threads = plan.cpu_threads if plan is not None else cpu_count() // env.local_world_size
        torch.set_num_threads(max(1, threads))
    if plan is None and env.is_master:  # before init: nobody has written anything yet
        note = check_run_dir(cfg, env.attempt)
        if note:
            log(env, note)
    env.init()
    timeline.mark("init")
    # Names a stalled rank instead of a bare collective timeout; stacks go to the run dir.
    stall_watchdog = watchdog.Watchdog.start(env, cfg.run_dir, cfg.distributed.timeout_s)
    model = optimizer = snapshots = records = None
    failed = False
    stop = StopSignals().install()  # noted from now on; the loop acts on it between steps
    try:
        # the calling process, when there is one, already logged what preparing the data found
        task = prepare_task(cfg, env, given, quiet=plan is not None)
        if plan is None:
            plan = plan_on_ranks(cfg, env, task)
        timeline.mark("data")
        model, optimizer, scheduler, scaler, n_params, frozen, pipeline = _build(plan, env, task)
        snapshots = Snapshotter(plan, env, model, optimizer, scheduler, scaler,
                                model_info=task.model_info, tokenizer_path=task.tokenizer_path)
        resumed = snapshots.resume()
        # (step, world size) from the first step on; a snapshot carries it to the next start
        history = list(resumed.loop.get("world_history", [[0, resumed.world_size]])) \
            if resumed is not None else []
        if not history or history[-1][1] != env.world_size:
            history.append([resumed.step if resumed else 0, env.world_size])
            if resumed is not None and cfg.distributed.elastic:  # a membership change
                change = "a node left" if env.world_size < resumed.world_size else "a node joined"
                log(env, f"world size {resumed.world_size} -> {env.world_size} at step "
                         f"{resumed.step} ({change}); resharded")
        snapshots.info["world_history"] = history
        if env.is_master:
            prepare_run_dir(cfg, None if resumed is None else resumed.step)
        timeline.mark("model")
        _log_start(plan, env, task, n_params, resumed)
        if cfg.trainer.verbose:
            log(env, "memory at start:\n" + format_memory_table(
                gather_memory(env, model, optimizer, frozen=list(frozen.values()))))

        best_dir = cfg.run_dir / BEST_DIR

        def save_best(step: int) -> None:  # collective: every rank gathers, rank 0 writes
            state = plan.parallelism.full_state_dict(model, env)
            if env.is_master:
                task.save(plan.parallelism.unwrap(model), best_dir / MODEL_DIR, state)

        loop = TrainLoop(plan, env, model, optimizer, scheduler, scaler, task, frozen=frozen,
                         snapshots=snapshots, resumed=resumed,
                         on_best=save_best if cfg.trainer.keep_best else None, stop=stop,
                         pipeline=pipeline)
        stall_watchdog.watch(loop.progress, plan.parallelism.roles(env.world_size))
        records = loggers.RunRecords.open(cfg, env, start_step=loop.step)  # TensorBoard, ...
        timeline.mark("records")
        last = loop.run(records)
        if loop.first_step_at:
            timeline.mark("first_step", loop.first_step_at)
            timeline.mark("last_step", loop.last_step_at)
        if loop.stopped_by:  # a stop signal: the snapshot is committed; no evaluation, no model
            return {"summary": {}, "run_dir": str(cfg.run_dir), "is_master": env.is_master,
                    "stopped_by": loop.stopped_by, "step": loop.step}
        snapshots.wait()  # the last snapshot in flight is committed before anything else
        val_loss = loop.evaluate()
        val_metrics = loop.val_metrics  # e.g. accuracy, for a classifier
        final_is_best = loop.best.update(loop.step, val_loss)
        # keep_best: the output is the best evaluation's weights, saved when it happened
        keep_best = cfg.trainer.keep_best and not final_is_best and loop.best.best_step is not None
        if keep_best:
            log(env, f"keeping the weights of step {loop.best.best_step} (validation loss "
                     f"{loop.best.best_loss:.4f}; the last step's is {val_loss:.4f})")
            val_loss, val_metrics = loop.best.best_loss, loop.best_metrics
        if val_loss is not None:
            log(env, f"validation loss {val_loss:.4f}" + (
                f" (perplexity {math.exp(val_loss):.2f})" if task.perplexity else "") + (
                f"; accuracy {val_metrics['val_accuracy']:.4f} on {val_metrics['val_samples']} "
                f"{task.sample_name}" if val_metrics.get("val_accuracy") is not None else ""))
        memory = gather_memory(env, model, optimizer, loop.grads_bytes, loop.activation_bytes,
                               list(frozen.values()))
        if cfg.trainer.verbose:
            log(env, "memory at end:\n" + format_memory_table(memory))

        state = None if keep_best else plan.parallelism.full_state_dict(model, env)
        summary = run_summary(plan, env, task, loop, last, val_loss, n_params, resumed,
                              snapshots.report(), memory, time.perf_counter() - t_start,
                              history)
        summary.update(val_metrics)
        summary.update(startup_s=timeline.phases(upto="first_step"),
                       timeline={"start": timeline.start, **timeline.marks})
        unwritten = None  # why rank 0 could not write the outputs (disk full, ...)
        if env.is_master:
            try:
                if keep_best:
                    for name in [p.name for p in best_dir.iterdir()]:  # model/ (and adapter/)
                        replace_dir(best_dir / name, cfg.run_dir / name)
                else:
                    task.save(plan.parallelism.unwrap(model), cfg.run_dir / MODEL_DIR, state)
                shutil.rmtree(best_dir, ignore_errors=True)
                atomic_write_json(cfg.run_dir / "summary.json", summary)  # finished: last
            except Exception as e:  # OSError, or a writer's own (safetensors: SafetensorError)
                unwritten = f"{type(e).__name__}: {first_line(e)}"
            else:
                records.finish(summary)  # memory per rank to the sinks; report.png
                loss = summary["final_loss"]  # None: no step logged (resumed at the end)
                log(env, f"done in {time.time() - timeline.start:.1f} s from the command's start "
                         f"({summary['wall_s']:.1f} s training): " + (
                    f"final loss {loss:.4f}; " if loss is not None else "") +
                    f"outputs in {cfg.run_dir}")
        # nobody leaves before rank 0 has written the model; if it could not, a snapshot of the
        # last step (every rank) lets the same command write it without training again
        unwritten = env.broadcast_object(unwritten)
        if unwritten:
            raise snapshots.outputs_failed(loop.step, loop.rank_state(),
                                           f"{cfg.run_dir / MODEL_DIR} ({unwritten})")
        return {"summary": summary, "run_dir": str(cfg.run_dir), "is_master": env.is_master,
                "stopped_by": 0}
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
        if records is not None:
            records.close()
        del model, optimizer, snapshots, records  # a live DDP module at teardown can abort
        env.teardown(barrier=not failed)


def prepare_task(cfg: TrainConfig, env: DistEnv,
                 given: Union[Task, TaskRecords, None] = None, quiet: bool = False) -> Task:
    """What is trained: a task already prepared (the user's own model and data, a Task object
    handed to the API, or one this process built), else the registered task of data.format,
    prepared from the config (and the Python API's records, when `given` holds them)."""
    say = (lambda m: None) if quiet else (lambda m: log(env, m))
    if given is not None and not isinstance(given, TaskRecords):
        return given
    return cfg.task.load().prepare(cfg, env, given, say)


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
                            compile=tr.compile, wrap=task.fsdp_wrap)
    frozen = {name: parallelize_frozen(prepare_model(m, plan.precision), plan.parallelism, env,
                                       precision=plan.precision, wrap=task.fsdp_wrap)
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
    log(env, f"{task.describe(n_params)}; strategy {plan.parallelism.name}{extras} "
             f"({plan.parallelism_reason}); {env.world_size} worker(s) on {env.device.type}; "
             f"precision {plan.precision}")
    dims = plan.dims
    split = f"{env.world_size} workers" if dims.tp == 1 and dims.pp == 1 else \
        f"{dims.dp} data-parallel group{'s' if dims.dp > 1 else ''} of {dims.tp} " \
        "tensor-parallel workers" if dims.pp == 1 else \
        f"{dims.dp} data-parallel worker{'s' if dims.dp > 1 else ''} per stage of a " \
        f"{dims.pp}-stage pipeline"
    log(env, f"batch: {tr.batch_size} per device x {split} x {plan.accum} "
             f"accumulation = {plan.global_batch} {task.sample_name}; {plan.total_steps} steps "
             f"({plan.steps_per_epoch} per epoch)")
    for line in optim.schedule_warnings(plan.cfg.optim, plan.total_steps):
        log(env, line)
    if resumed is not None:
        resharded = (f"; saved by {resumed.world_size} worker(s), resharded to "
                     f"{env.world_size}" if resumed.world_size != env.world_size else "")
        log(env, f"resumed from step {resumed.step} ({redact_url(resumed.url)}){resharded}")


def run_summary(plan: RunPlan, env: DistEnv, task: Task, loop: TrainLoop, last: dict,
                val_loss: Optional[float], n_params: int, resumed: Optional[Resumed],
                snapshots: dict, memory: list, wall_s: float, world_history: list) -> dict:
    """summary.json: what the run did, how fast, with what, and the memory of every rank."""
    cfg = plan.cfg
    return {
        "steps": loop.step, "epochs": loop.step / plan.steps_per_epoch,
        "final_loss": last.get("loss"), "val_loss": val_loss,
        "val_perplexity": math.exp(min(val_loss, 700))  # of a per-token cross-entropy only
        if val_loss is not None and task.unit_name == "tokens" else None,
        "wall_s": wall_s, "train_s": loop.train_s,
        # loss units: tokens for language models (the documented name), texts for a classifier
        "tokens_per_s": loop.units / max(loop.train_s, 1e-9), "tokens": loop.units,
        "loss_unit": task.unit_name,
        "data_wait_s": loop.data_wait_s, "step_times_s": loop.step_times,
        "step_cpu_s": loop.step_cpu_times,
        "world_size": env.world_size, "nnodes": env.nnodes, "world_history": world_history,
        "strategy": plan.parallelism.name,
        "strategy_reason": plan.parallelism_reason,
        "tensor_parallel": plan.dims.tp, "pipeline_parallel": plan.dims.pp,
        "parallel_dims": plan.dims.to_dict(),
        "activation_checkpointing": plan.activation_checkpointing,
        "cpu_offload": plan.parallelism.offloads_to_host,
        "precision": plan.precision, "batch_size": cfg.trainer.batch_size,
        "grad_accum": plan.accum, "global_batch_size": plan.global_batch,
        "seq_length": cfg.data.seq_length, "params": n_params,
        "resumed_from": None if resumed is None else {
            "step": resumed.step, "path": redact_url(resumed.url),
            "world_size": resumed.world_size},
        "snapshots": snapshots,
        "data_fingerprint": task.data_fingerprint, "memory": memory,
        "best_val_loss": loop.best.best_loss, "best_step": loop.best.best_step,
        "stopped_early": loop.stopped_early,
    }
