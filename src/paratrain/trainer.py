"""Trainer.fit(): check everything, start the workers, run the loop on each rank, return.

`fit()` is where a user's mistakes are caught (before a single process starts) and where the
three ways of running meet: in this process (one device), as workers started here through torch's
elastic agent (several devices, several nodes), or as one rank started by torchrun / Slurm.
`train()` is one rank's whole run; the loop itself lives in loop.py.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from . import checkpoint, launch, loggers, metrics, optim, precision, strategies, watchdog
from .config import TrainConfig
from .dist import DistEnv, restart_attempt
from .errors import ConfigError, DataError, RunDirError
from .loop import TrainLoop
from .metrics import log
from .snapshot import shown
from .task import LMTask, UserTask, check_picklable

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", checkpoint.MODEL_DIR)


@dataclass
class RunResult:
    """What fit() returns in the calling process. On a non-master node of a multi-node job
    `is_master` is False and the figures are those that node saw."""
    run_dir: Path
    final_loss: Optional[float]
    val_loss: Optional[float]
    steps: int
    summary: dict = field(default_factory=dict)
    is_master: bool = True


class Trainer:
    """`Trainer(cfg).fit()` for the built-in models, or your own model and data:

        Trainer(model=make_model, train_data=ds, val_data=val, loss_fn=fn, collate_fn=None,
                fsdp_wrap=[MyBlock], devices="cpu:2", strategy="fsdp", max_steps=100).fit()

    `model` is a factory (called inside each worker, so nothing large is pickled); without
    `loss_fn` the model must return its loss. Keyword arguments set `trainer.*` and `optim.*`
    keys by name (devices=, strategy=, batch_size=, lr=, ...), plus `run_dir=`, `run_name=`,
    `overwrite=`; `distributed_config={...}` sets `distributed.*`; `overrides=[...]` takes
    dotted keys."""

    def __init__(self, cfg: Optional[TrainConfig] = None, *, overrides: Sequence[str] = (),
                 model: Optional[Callable[[], nn.Module]] = None, train_data: Any = None,
                 val_data: Any = None, loss_fn: Optional[Callable] = None,
                 collate_fn: Optional[Callable] = None, fsdp_wrap: Sequence[type] = (),
                 distributed_config: Optional[dict] = None, **kwargs: Any):
        if (model is None) != (train_data is None):
            raise ConfigError("pass model= (a factory returning an nn.Module) and train_data= (a "
                              "map-style dataset) together, or neither")
        if cfg is None:
            cfg = TrainConfig.from_yaml(None, ["run.name=custom"] if model is not None else [])
        sections = {**{k: "trainer" for k in TrainConfig().trainer.__dataclass_fields__},
                    **{k: "optim" for k in TrainConfig().optim.__dataclass_fields__},
                    "run_dir": "run.dir", "run_name": "run.name", "overwrite": "run.overwrite"}
        dotted = list(overrides)
        for k, v in kwargs.items():
            if k not in sections:
                raise ConfigError(f"Trainer() got an unknown argument {k!r}; it takes trainer "
                                  f"and optim keys by name: {', '.join(sorted(sections))}")
            key = sections[k] if "." in sections[k] else f"{sections[k]}.{k}"
            dotted.append(f"{key}={_dot_value(v)}")
        for k, v in (distributed_config or {}).items():
            dotted.append(f"distributed.{k}={_dot_value(v)}")
        self.cfg = cfg.with_overrides(dotted) if dotted else cfg
        self.user = None if model is None else UserTask(
            model, train_data, val_data, loss_fn, collate_fn, tuple(fsdp_wrap))

    def fit(self) -> RunResult:
        cfg = self.cfg
        launcher = launch.detect_launcher()
        if launcher is not None:  # torchrun / Slurm started us: we are one rank
            env = launch.worker_dist_env(launcher, cfg.trainer.devices, cfg.distributed.backend,
                                         cfg.distributed.timeout_s)
            return _result(train(cfg, dataclasses.replace(env, attempt=restart_attempt()),
                                 self.user))
        devices = launch.parse_devices(cfg.trainer.devices)
        d = cfg.distributed
        # Everything a user can get wrong is checked here, before a single worker starts.
        world = len(devices) * d.nnodes
        _, global_batch = batch_plan(cfg.trainer.batch_size, world, cfg.trainer.global_batch_size)
        if self.user is not None:
            check_picklable(model=self.user.model_factory, train_data=self.user.train_ds,
                            val_data=self.user.val_ds, loss_fn=self.user.loss_fn,
                            collate_fn=self.user.collate_fn)
            steps_per_epoch(len(self.user.train_ds), global_batch, "train_data")
        strategies.resolve_strategy(cfg.trainer.strategy,
                                    DistEnv(world_size=world, local_world_size=len(devices),
                                            device=devices[0]),
                                    cpu_offload=cfg.trainer.cpu_offload)
        precision.check_precision(cfg.trainer.precision, devices[0])
        loggers.check_log_config(cfg.log)  # log.wandb=true without wandb: say so now
        if d.node_rank == 0:  # only node 0 writes outputs
            check_run_dir(cfg)
        if (len(devices) == 1 or cfg.trainer.strategy == "dp") and d.nnodes == 1:
            return _result(train(cfg, DistEnv.single(devices[0]), self.user))
        from .data import prepare_data
        with launch.join_nodes(d.master_addr, d.master_port, d.nnodes, d.node_rank, len(devices),
                               d.timeout_s, config=cfg.to_dict(), rdzv=d.rdzv) as nodes:
            if self.user is None:
                # node 0 first: a cache in a shared directory is built once, then reused
                prepared = nodes.first_then_others("data", lambda: prepare_data(
                    cfg.data, cfg.cache_dir,
                    log=lambda m: log(DistEnv(node_rank=d.node_rank), m)))
                from .data import build_dataset
                steps_per_epoch(len(build_dataset(prepared, "train", cfg.data)), global_batch,
                                "data.source", cfg)
            results = nodes.launch(worker_entry,
                                   (cfg.to_dict(), [str(x) for x in devices], self.user),
                                   max_restarts=d.max_restarts)
        return _result(results[min(results)])


def worker_entry(cfg_dict: dict, devices: list[str], user: Optional[UserTask] = None) -> dict:
    """One worker started by the elastic agent (pickled by name, so it lives at module level)."""
    from torch.distributed.elastic.multiprocessing.errors import record
    return record(_worker_main)(cfg_dict, devices, user)


def _worker_main(cfg_dict: dict, devices: list[str], user: Optional[UserTask]) -> dict:
    cfg = TrainConfig.from_dict(cfg_dict)
    launcher = launch.detect_launcher()
    assert launcher is not None, "worker_entry runs under the elastic agent"
    env = launch.worker_dist_env(launcher, cfg.trainer.devices, cfg.distributed.backend,
                                 cfg.distributed.timeout_s, devices=devices)
    return train(cfg, dataclasses.replace(env, attempt=restart_attempt()), user)


def check_run_dir(cfg: TrainConfig, attempt: int = 0) -> None:
    """Refuse to write over another run unless told to: nothing of it is lost by a typo. Not in
    the way: an unfinished run that checkpoint.resume continues from a committed snapshot, and
    our own run when the elastic agent restarts its workers (attempt > 0)."""
    d = cfg.run_dir
    if d.exists() and not d.is_dir():
        raise RunDirError(f"run.dir {str(d)!r} is a file; choose another run.name or run.dir")
    held = [f for f in RUN_FILES if (d / f).exists()]
    if held and not cfg.run.overwrite and attempt == 0 and not checkpoint.continues(cfg, held):
        raise RunDirError(f"run.dir {str(d)!r} already holds a run ({', '.join(held)}); choose "
                          "another run.name or run.dir, or pass run.overwrite=true to replace it")


def _result(out: dict) -> RunResult:
    s = out["summary"]
    return RunResult(run_dir=Path(out["run_dir"]), final_loss=s.get("final_loss"),
                     val_loss=s.get("val_loss"), steps=s.get("steps", 0), summary=s,
                     is_master=out["is_master"])


# ---- one rank ----------------------------------------------------------------------------------
def train(cfg: TrainConfig, env: DistEnv, user: Optional[UserTask] = None) -> dict:
    """The whole run on one rank: set up, loop, evaluate, save, tear down."""
    from .models import count_params

    t_start = time.perf_counter()
    if env.device.type == "cpu":  # ranks sharing the cores: one slice each, not all each
        torch.set_num_threads(max(1, launch.cpu_count() // env.local_world_size))
    if env.is_master:  # before init: nobody has written anything yet
        check_run_dir(cfg, env.attempt)
    precision.check_precision(cfg.trainer.precision, env.device)
    loggers.check_log_config(cfg.log)  # every rank, before any of them waits on another
    env.init()
    # Names a stalled rank instead of a bare collective timeout; stacks go to the run dir.
    dog = watchdog.Watchdog.start(env, cfg.run_dir, cfg.distributed.timeout_s)
    model = optimizer = snaps = records = None
    failed = False
    try:
        task = user if user is not None else LMTask.prepare(cfg, env, lambda m: log(env, m))
        tr = cfg.trainer
        strategy, why, ac, offload = _pick_strategy(cfg, env, task)
        # nn.DataParallel splits one process's batch over its GPUs: batch_size per GPU, still
        replicas = len(launch.parse_devices(tr.devices)) if strategy == "dp" else 1
        accum, global_batch = batch_plan(tr.batch_size, env.world_size * replicas,
                                         tr.global_batch_size)
        per_epoch = steps_per_epoch(len(task.train_ds), global_batch,
                                    "data.source" if user is None else "train_data", cfg)
        total_steps = tr.max_steps or tr.epochs * per_epoch

        torch.manual_seed(tr.seed)  # the same initial weights on every rank
        model = precision.prepare_model(task.build_model(), tr.precision)
        n_params = count_params(model)
        model = strategies.parallelize(model, strategy, env, activation_checkpointing=ac,
                                       compile=tr.compile, precision=tr.precision,
                                       cpu_offload=offload,
                                       reshard_after_forward=tr.reshard_after_forward,
                                       wrap=task.fsdp_wrap)
        torch.manual_seed(tr.seed + 1 + env.rank)  # dropout differs between ranks
        optimizer = optim.build_optimizer(model, cfg.optim, env.device)
        scheduler = optim.build_scheduler(optimizer, cfg.optim, total_steps)
        scaler = precision.grad_scaler(tr.precision, env.device, strategies.is_fsdp(model))

        snaps = checkpoint.Snapshotter(
            cfg, env, model, optimizer, scheduler, scaler, tokenizer_path=task.tokenizer_path,
            info={"strategy": strategy, "precision": tr.precision, "model": task.model_info,
                  "global_batch": global_batch, "steps_per_epoch": per_epoch,
                  "total_steps": total_steps})
        resumed = snaps.resume()
        run_dir = cfg.run_dir
        if env.is_master:
            run_dir.mkdir(parents=True, exist_ok=True)
            for stale in ("metrics.jsonl", "samples.jsonl", "summary.json"):
                if resumed is not None and stale.endswith(".jsonl"):
                    checkpoint.trim_jsonl(run_dir / stale, resumed.step)  # those steps run again
                else:  # a fresh start (run.overwrite=true, or a restart before any snapshot)
                    (run_dir / stale).unlink(missing_ok=True)
            metrics.write_text_atomic(run_dir / "config.yaml", cfg.to_yaml(redact=True))
        extras = "".join([" + activation checkpointing" if ac else "",
                          " + CPU offload" if offload else ""])
        log(env, f"{task.describe(n_params)}; strategy {strategy}{extras} ({why}); "
                 f"{env.world_size} worker(s) on {env.device.type}; precision {tr.precision}")
        unit = "samples" if user is not None else \
            f"sequences of {cfg.data.seq_length} tokens"
        log(env, f"batch: {tr.batch_size} per device x {env.world_size} workers x {accum} "
                 f"accumulation = {global_batch} {unit}; {total_steps} steps "
                 f"({per_epoch} per epoch)")
        if resumed is not None:
            resharded = (f"; saved by {resumed.world_size} worker(s), resharded to "
                         f"{env.world_size}" if resumed.world_size != env.world_size else "")
            log(env, f"resumed from step {resumed.step} ({shown(resumed.url)}){resharded}")
        if tr.verbose:
            log(env, "memory at start:\n" + metrics.format_memory_table(
                metrics.gather_memory(env, model, optimizer)))

        loop = TrainLoop(cfg, env, model, optimizer, scheduler, scaler, task, accum,
                         global_batch, per_epoch, total_steps, snapshots=snaps, resumed=resumed)
        dog.watch(loop.progress)
        records = loggers.RunRecords.open(cfg, env, start_step=loop.step)  # TensorBoard, ...
        last = loop.run(records)
        snaps.close()  # the last snapshot in flight is committed before anything else
        val_loss = loop.evaluate()
        if val_loss is not None:
            log(env, f"validation loss {val_loss:.4f}" + (
                f" (perplexity {math.exp(val_loss):.2f})" if user is None else ""))
        memory = metrics.gather_memory(env, model, optimizer, loop.grads_bytes,
                                       loop.activation_bytes)
        if tr.verbose:
            log(env, "memory at end:\n" + metrics.format_memory_table(memory))

        state = checkpoint.full_state_dict(model, env)
        wall = time.perf_counter() - t_start
        summary = {
            "steps": total_steps, "epochs": total_steps / per_epoch,
            "final_loss": last.get("loss"), "val_loss": val_loss,
            "val_perplexity": math.exp(min(val_loss, 700)) if val_loss is not None else None,
            "wall_s": wall, "train_s": loop.train_s,
            "tokens_per_s": loop.tokens / max(loop.train_s, 1e-9), "tokens": loop.tokens,
            "data_wait_s": loop.data_wait_s, "step_times_s": loop.step_times,
            "step_cpu_s": loop.step_cpu_times,
            "world_size": env.world_size, "nnodes": env.nnodes, "strategy": strategy,
            "strategy_reason": why, "activation_checkpointing": ac, "cpu_offload": offload,
            "precision": tr.precision, "batch_size": tr.batch_size,
            "grad_accum": accum, "global_batch_size": global_batch,
            "seq_length": cfg.data.seq_length, "params": n_params,
            "resumed_from": None if resumed is None else {
                "step": resumed.step, "path": shown(resumed.url),
                "world_size": resumed.world_size},
            "snapshots": snaps.report(),
            "data_fingerprint": task.data_fingerprint, "memory": memory,
        }
        if env.is_master:
            task.save(model, run_dir / checkpoint.MODEL_DIR, state)
            metrics.write_json_atomic(run_dir / "summary.json", summary)
            records.finish(summary)  # memory per rank to the sinks; report.png
            log(env, f"done in {wall:.1f} s: final loss {summary['final_loss']:.4f}; outputs "
                     f"in {run_dir}")
        env.barrier()  # nobody leaves before rank 0 has written the model
        return {"summary": summary, "run_dir": str(run_dir), "is_master": env.is_master}
    except Exception as e:
        failed = True
        stalled = dog.explain(e)  # a collective timed out: who stalled, and where
        if stalled is not None:
            raise stalled from e
        raise
    finally:
        dog.stop()
        if records is not None:
            records.close()
        del model, optimizer, snaps, records
        env.teardown(barrier=not failed)


def _pick_strategy(cfg: TrainConfig, env: DistEnv, task: Any) -> tuple[str, str, bool, bool]:
    """(strategy, why, activation checkpointing, cpu offload). For `auto` on several devices the
    memory plan decides, on rank 0 (device capacities differ a little between ranks; the choice
    must not), and everyone follows. The plan probes our own models; other models get ddp."""
    tr = cfg.trainer
    planned = None
    plannable = isinstance(task, LMTask) and cfg.model.arch != "hf"
    if tr.strategy == "auto" and env.world_size > 1 and not tr.cpu_offload and plannable:
        if env.is_master:
            from . import plan
            rows = plan.estimate(task.build_model, world=env.world_size, precision=tr.precision,
                                 micro_batch=tr.batch_size, seq_length=cfg.data.seq_length,
                                 vocab_size=task.args.vocab_size)
            planned = plan.choose(rows, plan.device_capacity(env.device, env.local_world_size))
        planned = env.broadcast_object(planned)
    strategy, why = strategies.resolve_strategy(tr.strategy, env, cpu_offload=tr.cpu_offload,
                                                planned=planned)
    base, _, extra = strategy.partition("+")
    return (base, why, tr.activation_checkpointing or extra in ("ac", "offload"),
            tr.cpu_offload or extra == "offload")


def steps_per_epoch(n_samples: int, global_batch: int, source: str,
                    cfg: Optional[TrainConfig] = None) -> int:
    """Optimizer steps in one pass over the training set, or a DataError when the data cannot
    fill one global batch."""
    steps = n_samples // global_batch
    if steps < 1:
        if cfg is not None and source == "data.source":
            raise DataError(f"data.source={cfg.data.source!r} gives {n_samples} training "
                            f"sequences of data.seq_length={cfg.data.seq_length}, fewer than one "
                            f"global batch of {global_batch} (trainer.batch_size x workers x "
                            "accumulation); use more text, a shorter data.seq_length or a "
                            "smaller batch")
        raise DataError(f"{source} has {n_samples} samples, fewer than one global batch of "
                        f"{global_batch} (trainer.batch_size x workers x accumulation); use more "
                        "data or a smaller batch")
    return steps


def batch_plan(batch_size: int, world_size: int, global_batch_size: Optional[int]
               ) -> tuple[int, int]:
    """(accumulation micro-steps, global batch). With a global batch the run is the same
    whatever the world size; without one, the global batch grows with the workers."""
    per_step = batch_size * world_size
    if global_batch_size is None:
        return 1, per_step
    if global_batch_size % per_step:
        raise ConfigError(f"trainer.global_batch_size={global_batch_size} is not divisible by "
                          f"trainer.batch_size x workers = {batch_size} x {world_size} = "
                          f"{per_step}; pick a multiple of {per_step}")
    return global_batch_size // per_step, global_batch_size


def _dot_value(v: Any) -> str:
    """A Python value as OmegaConf's dotlist parser reads it back."""
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_dot_value(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
