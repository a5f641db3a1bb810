"""Trainer.fit(): check everything, start the workers, run the loop on each rank, return.

The loop is the nanoGPT loop with three rules that make it exact across world sizes:
- every global batch is the same set of samples whatever the world size (GlobalSampler);
- the loss is a token-weighted mean over all ranks and micro-steps: each micro-step backpropagates
  sum(token losses) * world / (tokens in the global batch), and DDP's gradient mean over ranks
  undoes the `* world`, so the gradient does not depend on how the batch was split;
- validation visits every sample exactly once, and every rank runs the same number of batches
  (a rank out of samples runs a dummy batch that counts zero tokens), so wrappers that
  communicate in forward never wait on a rank that has stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from . import checkpoint, launch, metrics, optim, precision, strategies, watchdog
from .config import TrainConfig
from .dist import DistEnv, restart_attempt
from .errors import ConfigError, DataError, RunDirError
from .metrics import log
from .snapshot import shown

IGNORE_INDEX = -100
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
    """`Trainer(cfg).fit()`; keyword arguments set `trainer.*` keys (devices=, strategy=, ...),
    `distributed_config={...}` sets `distributed.*`, `overrides=[...]` takes dotted keys."""

    def __init__(self, cfg: Optional[TrainConfig] = None, *, overrides: tuple = (),
                 distributed_config: Optional[dict] = None, **trainer_kwargs: Any):
        cfg = cfg if cfg is not None else TrainConfig.from_yaml()
        known = set(TrainConfig().trainer.__dataclass_fields__)
        dotted = list(overrides)
        for k, v in trainer_kwargs.items():
            if k not in known:
                raise ConfigError(f"Trainer() got an unknown argument {k!r}; trainer keys are: "
                                  f"{', '.join(sorted(known))}")
            dotted.append(f"trainer.{k}={_dot_value(v)}")
        for k, v in (distributed_config or {}).items():
            dotted.append(f"distributed.{k}={_dot_value(v)}")
        self.cfg = cfg.with_overrides(dotted) if dotted else cfg

    def fit(self) -> RunResult:
        cfg = self.cfg
        launcher = launch.detect_launcher()
        if launcher is not None:  # torchrun / Slurm started us: we are one rank
            env = launch.worker_dist_env(launcher, cfg.trainer.devices, cfg.distributed.backend,
                                         cfg.distributed.timeout_s)
            return _result(train(cfg, dataclasses.replace(env, attempt=restart_attempt())))
        devices = launch.parse_devices(cfg.trainer.devices)
        d = cfg.distributed
        # Everything a user can get wrong is checked here, before a single worker starts.
        world = len(devices) * d.nnodes
        batch_plan(cfg.trainer.batch_size, world, cfg.trainer.global_batch_size)
        strategies.resolve_strategy(cfg.trainer.strategy,
                                    DistEnv(world_size=world, local_world_size=len(devices),
                                            device=devices[0]),
                                    cpu_offload=cfg.trainer.cpu_offload)
        precision.check_precision(cfg.trainer.precision, devices[0])
        if d.node_rank == 0:  # only node 0 writes outputs
            check_run_dir(cfg)
        if (len(devices) == 1 or cfg.trainer.strategy == "dp") and d.nnodes == 1:
            return _result(train(cfg, DistEnv.single(devices[0])))
        from .data import prepare_data
        with launch.join_nodes(d.master_addr, d.master_port, d.nnodes, d.node_rank, len(devices),
                               d.timeout_s, config=cfg.to_dict(), rdzv=d.rdzv) as nodes:
            # node 0 first: a cache in a shared directory is built once, then reused
            prepared = nodes.first_then_others("data", lambda: prepare_data(
                cfg.data, cfg.cache_dir, log=lambda m: log(DistEnv(node_rank=d.node_rank), m)))
            data_plan(cfg, prepared, world)
            results = nodes.launch(worker_entry, (cfg.to_dict(), [str(x) for x in devices]),
                                   max_restarts=d.max_restarts)
        return _result(results[min(results)])


def worker_entry(cfg_dict: dict, devices: list[str]) -> dict:
    """One worker started by the elastic agent (pickled by name, so it lives at module level)."""
    from torch.distributed.elastic.multiprocessing.errors import record
    return record(_worker_main)(cfg_dict, devices)


def _worker_main(cfg_dict: dict, devices: list[str]) -> dict:
    cfg = TrainConfig.from_dict(cfg_dict)
    launcher = launch.detect_launcher()
    assert launcher is not None, "worker_entry runs under the elastic agent"
    env = launch.worker_dist_env(launcher, cfg.trainer.devices, cfg.distributed.backend,
                                 cfg.distributed.timeout_s, devices=devices)
    return train(cfg, dataclasses.replace(env, attempt=restart_attempt()))


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
def train(cfg: TrainConfig, env: DistEnv) -> dict:
    """The whole run on one rank: set up, loop, evaluate, save, tear down."""
    from .data import prepare_data, wait_for_data
    from .models import build_model, count_params, resolve_model_config

    t_start = time.perf_counter()
    if env.device.type == "cpu":  # ranks sharing the cores: one slice each, not all each
        torch.set_num_threads(max(1, launch.cpu_count() // env.local_world_size))
    if env.is_master:  # before init: nobody has written anything yet
        check_run_dir(cfg, env.attempt)
    precision.check_precision(cfg.trainer.precision, env.device)
    env.init()
    # Names a stalled rank instead of a bare collective timeout; stacks go to the run dir.
    dog = watchdog.Watchdog.start(env, cfg.run_dir, cfg.distributed.timeout_s)
    model = optimizer = snaps = None
    failed = False
    try:
        # Data: local rank 0 builds the cache (a no-op when the launcher already did), the
        # other ranks of the node wait for it; a node that shares the directory reuses it.
        if env.is_local_master:
            prepared = prepare_data(cfg.data, cfg.cache_dir, log=lambda m: log(env, m))
        else:
            prepared = wait_for_data(cfg.data, cfg.cache_dir, timeout_s=3600.0)
        tokenizer = prepared.tokenizer()
        tr = cfg.trainer
        args = resolve_model_config(cfg.model, vocab_size=cfg.model.vocab_size or
                                    tokenizer.vocab_size, seq_length=cfg.data.seq_length)
        strategy, why, ac, offload = _pick_strategy(cfg, env, lambda: build_model(args),
                                                    args.vocab_size)
        # nn.DataParallel splits one process's batch over its GPUs: batch_size per GPU, still
        replicas = len(launch.parse_devices(tr.devices)) if strategy == "dp" else 1
        train_ds, val_ds, accum, global_batch, steps_per_epoch = data_plan(
            cfg, prepared, env.world_size * replicas)
        total_steps = tr.max_steps or tr.epochs * steps_per_epoch

        torch.manual_seed(tr.seed)  # the same initial weights on every rank
        model = precision.prepare_model(build_model(args), tr.precision)
        n_params = count_params(model)
        model = strategies.parallelize(model, strategy, env, activation_checkpointing=ac,
                                       compile=tr.compile, precision=tr.precision,
                                       cpu_offload=offload,
                                       reshard_after_forward=tr.reshard_after_forward)
        torch.manual_seed(tr.seed + 1 + env.rank)  # dropout differs between ranks
        optimizer = optim.build_optimizer(model, cfg.optim, env.device)
        scheduler = optim.build_scheduler(optimizer, cfg.optim, total_steps)
        scaler = precision.grad_scaler(tr.precision, env.device, strategies.is_fsdp(model))

        snaps = checkpoint.Snapshotter(
            cfg, env, model, optimizer, scheduler, scaler, tokenizer_path=prepared.tokenizer_path,
            info={"strategy": strategy, "precision": tr.precision, "model": args.to_dict(),
                  "global_batch": global_batch, "steps_per_epoch": steps_per_epoch,
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
        log(env, f"model {args.arch}: {n_params / 1e6:.2f}M parameters; strategy {strategy}"
                 f"{extras} ({why}); {env.world_size} worker(s) on {env.device.type}; "
                 f"precision {tr.precision}")
        log(env, f"batch: {tr.batch_size} per device x {env.world_size} workers x {accum} "
                 f"accumulation = {global_batch} sequences of {cfg.data.seq_length} tokens; "
                 f"{total_steps} steps ({steps_per_epoch} per epoch)")
        if resumed is not None:
            resharded = (f"; saved by {resumed.world_size} worker(s), resharded to "
                         f"{env.world_size}" if resumed.world_size != env.world_size else "")
            log(env, f"resumed from step {resumed.step} ({shown(resumed.url)}){resharded}")
        if tr.verbose:
            log(env, "memory at start:\n" + metrics.format_memory_table(
                metrics.gather_memory(env, model, optimizer)))

        loop = _Loop(cfg, env, model, optimizer, scheduler, scaler, train_ds, val_ds,
                     accum, global_batch, steps_per_epoch, total_steps, snapshots=snaps,
                     resumed=resumed)
        dog.watch(loop.progress)
        last = loop.run()
        snaps.close()  # the last snapshot in flight is committed before anything else
        val_loss = loop.evaluate()
        if val_loss is not None:
            log(env, f"validation loss {val_loss:.4f} (perplexity {math.exp(val_loss):.2f})")
        memory = metrics.gather_memory(env, model, optimizer, loop.grads_bytes,
                                       loop.activation_bytes)
        if tr.verbose:
            log(env, "memory at end:\n" + metrics.format_memory_table(memory))

        state = checkpoint.full_state_dict(model, env)
        wall = time.perf_counter() - t_start
        summary = {
            "steps": total_steps, "epochs": total_steps / steps_per_epoch,
            "final_loss": last.get("loss"), "val_loss": val_loss,
            "val_perplexity": math.exp(val_loss) if val_loss is not None else None,
            "wall_s": wall, "train_s": loop.train_s,
            "tokens_per_s": loop.tokens / max(loop.train_s, 1e-9), "tokens": loop.tokens,
            "data_wait_s": loop.data_wait_s, "step_times_s": loop.step_times,
            "world_size": env.world_size, "nnodes": env.nnodes, "strategy": strategy,
            "strategy_reason": why, "activation_checkpointing": ac, "cpu_offload": offload,
            "precision": tr.precision, "batch_size": tr.batch_size,
            "grad_accum": accum, "global_batch_size": global_batch,
            "seq_length": cfg.data.seq_length, "params": n_params,
            "resumed_from": None if resumed is None else {
                "step": resumed.step, "path": shown(resumed.url),
                "world_size": resumed.world_size},
            "snapshots": snaps.report(),
            "data_fingerprint": prepared.meta.get("fingerprint"), "memory": memory,
        }
        if env.is_master:
            checkpoint.save_model(run_dir / checkpoint.MODEL_DIR, state, args.to_dict(),
                                  prepared.tokenizer_path)
            metrics.write_json_atomic(run_dir / "summary.json", summary)
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
        del model, optimizer, snaps
        env.teardown(barrier=not failed)


def _pick_strategy(cfg: TrainConfig, env: DistEnv, factory: Any, vocab_size: int
                   ) -> tuple[str, str, bool, bool]:
    """(strategy, why, activation checkpointing, cpu offload). For `auto` on several devices the
    memory plan decides, on rank 0 (device capacities differ a little between ranks; the choice
    must not), and everyone follows."""
    tr = cfg.trainer
    planned = None
    if tr.strategy == "auto" and env.world_size > 1 and not tr.cpu_offload:
        if env.is_master:
            from . import plan
            rows = plan.estimate(factory, world=env.world_size, precision=tr.precision,
                                 micro_batch=tr.batch_size, seq_length=cfg.data.seq_length,
                                 vocab_size=vocab_size)
            planned = plan.choose(rows, plan.device_capacity(env.device, env.local_world_size))
        planned = env.broadcast_object(planned)
    strategy, why = strategies.resolve_strategy(tr.strategy, env, cpu_offload=tr.cpu_offload,
                                                planned=planned)
    base, _, extra = strategy.partition("+")
    return (base, why, tr.activation_checkpointing or extra in ("ac", "offload"),
            tr.cpu_offload or extra == "offload")


def data_plan(cfg: TrainConfig, prepared: Any, world_size: int) -> tuple:
    """(train set, validation set, accumulation, global batch, steps per epoch), or a DataError
    when the corpus cannot fill one global batch."""
    from .data import build_dataset
    train_ds = build_dataset(prepared, "train", cfg.data)
    val_ds = build_dataset(prepared, "val", cfg.data)
    tr = cfg.trainer
    accum, global_batch = batch_plan(tr.batch_size, world_size, tr.global_batch_size)
    steps_per_epoch = len(train_ds) // global_batch
    if steps_per_epoch < 1:
        raise DataError(f"data.source={cfg.data.source!r} gives {len(train_ds)} training "
                        f"sequences of data.seq_length={cfg.data.seq_length}, fewer than one "
                        f"global batch of {global_batch} (trainer.batch_size={tr.batch_size} x "
                        f"{world_size} workers x {accum} accumulation); use more text, a shorter "
                        "data.seq_length or a smaller batch")
    return train_ds, val_ds, accum, global_batch, steps_per_epoch


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


class _Loop:
    """The training loop of one rank; state lives here so a later snapshot can save it."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                 train_ds: Any, val_ds: Any, accum: int, global_batch: int,
                 steps_per_epoch: int, total_steps: int, *,
                 snapshots: Optional[checkpoint.Snapshotter] = None,
                 resumed: Optional[checkpoint.Resumed] = None):
        from .data import GlobalSampler
        self.cfg, self.env, self.model = cfg, env, model
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.val_ds = val_ds
        self.accum, self.global_batch = accum, global_batch
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.step = 0
        self.tokens = 0
        self.train_s = 0.0
        self.grads_bytes: Optional[int] = None  # measured once, while gradients exist
        self.data_wait_s = 0.0  # time the loop waited for batches: should be ~0
        self.progress = watchdog.Progress()  # where this rank is, for the stalled-rank watchdog
        self.activation_bytes: Optional[int] = None  # saved for backward by one micro-step
        # Wall time of every step, end to end (data, step, logging, bar): `paratrain bench`
        # takes the median after warm-up, which leaves start-up and compilation out.
        self.step_times: list[float] = []
        self.sampler = GlobalSampler(len(train_ds), env.world_size, env.rank, cfg.trainer.seed,
                                     shuffle=True, drop_last=True, global_batch=global_batch)
        # per process and micro-step: batch_size, or batch_size x GPUs under nn.DataParallel
        self.micro_batch = global_batch // (env.world_size * accum)
        self.fsdp = strategies.is_fsdp(model)
        # checkpoint.record_samples: a pass-through that notes which samples each step took
        self.recorder = checkpoint.SampleRecorder(self.sampler) \
            if cfg.checkpoint.record_samples else None
        self.loader = _loader(train_ds, self.sampler if self.recorder is None else self.recorder,
                              self.micro_batch, cfg, env)
        self.static_tokens = cfg.data.format == "packed"  # no ignored targets: count is known
        self.snapshots = snapshots
        self.carry = (0.0, 0.0)  # this rank's loss sum and tokens since the last log line
        if resumed is not None:
            self._restore(resumed)

    def _restore(self, resumed: checkpoint.Resumed) -> None:
        """Continue after optimizer step `resumed.step`. The sampler skips what the steps of
        this epoch consumed, counted globally, so any world size continues the same order."""
        self.step = resumed.step
        epoch, done = divmod(self.step, self.steps_per_epoch)
        self.sampler.load_state_dict({"epoch": epoch, "seed": self.sampler.seed,
                                      "position": done * self.global_batch // self.env.world_size})
        if resumed.rank is not None:
            self.carry = (resumed.rank["loss_sum"], resumed.rank["count"])
        elif self.env.is_master:  # another world size: the window's sums move to rank 0
            ranks = resumed.loop["ranks"]
            self.carry = (sum(r["loss_sum"] for r in ranks), sum(r["count"] for r in ranks))

    def _snapshot(self, loss_sum: float, count: float) -> None:
        epoch, done = divmod(self.step, self.steps_per_epoch)
        self.snapshots.save(self.step, {"epoch": epoch, "samples_in_epoch": done *  # type: ignore
                                        self.global_batch, "sampler_seed": self.sampler.seed},
                            {"loss_sum": loss_sum, "count": count})

    def _micro_batches(self) -> Iterator[dict]:
        epoch = self.step // self.steps_per_epoch
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def run(self) -> dict:
        cfg, env, tr = self.cfg, self.env, self.cfg.trainer
        mlog = metrics.MetricsLog(cfg.run_dir / "metrics.jsonl" if env.is_master else None)
        bar = metrics.ProgressBar(env, self.total_steps, self.step, tr.progress_bar)
        window = metrics.Throughput()
        loss_sum, count = self.carry  # since the last log line, this rank
        slog = metrics.MetricsLog(cfg.run_dir / "samples.jsonl"
                                  if env.is_master and self.recorder is not None else None)
        last: dict = {}
        batches = self._micro_batches()
        t0 = t_step = time.perf_counter()
        try:
            while self.step < self.total_steps:
                t_data = time.perf_counter()
                self.progress.at(self.step + 1, "data")
                micro = [next(batches) for _ in range(self.accum)]
                window.wait(time.perf_counter() - t_data)
                self.data_wait_s += time.perf_counter() - t_data
                s, n, grad_norm = self._train_step(micro)
                loss_sum += s
                count += n
                self.step += 1
                if self.recorder is not None:  # every rank's sample ids of this step
                    ids = env.gather_objects(self.recorder.pop())
                    slog.write({"step": self.step, "ids": sorted(i for r in ids for i in r)})
                window.add(n_tokens := self.global_batch * cfg.data.seq_length)
                self.tokens += n_tokens
                evaluate = self.step % tr.eval_every == 0 and self.step < self.total_steps
                if self.step % tr.log_every == 0 or evaluate or self.step == self.total_steps:
                    loss = env.weighted_mean(loss_sum, count)
                    loss_sum = count = 0.0
                    last = {"step": self.step, "epoch": (self.step - 1) // self.steps_per_epoch,
                            "loss": loss, "lr": self.scheduler.get_last_lr()[0],
                            "grad_norm": grad_norm, **window.report()}
                    if evaluate:
                        last["val_loss"] = self.evaluate()
                    mlog.write(last)
                    bar.update(0, loss=f"{loss:.3f}", lr=f"{last['lr']:.2e}")
                bar.update(1)
                if tr.verbose and self.step % self.steps_per_epoch == 0 \
                        and self.step < self.total_steps:  # the end of an epoch
                    bar.write("memory after epoch "
                              f"{self.step // self.steps_per_epoch}:\n" +
                              metrics.format_memory_table(metrics.gather_memory(
                                  env, self.model, self.optimizer, self.grads_bytes,
                                  self.activation_bytes)))
                if self.snapshots is not None and self.snapshots.due(
                        self.step, self.steps_per_epoch, self.total_steps):
                    self._snapshot(loss_sum, count)
                now = time.perf_counter()
                self.step_times.append(now - t_step)
                t_step = now
        finally:
            self.train_s += time.perf_counter() - t0
            bar.close()
            mlog.close()
            slog.close()
        return last

    def _train_step(self, micro: list[dict]) -> tuple[float, float, float]:
        """One optimizer step over `accum` micro-batches; returns this rank's (sum of token
        losses, tokens) and the global gradient norm before clipping."""
        env, model = self.env, self.model
        if self.static_tokens:
            global_tokens = float(self.global_batch * self.cfg.data.seq_length)
        else:
            local = sum(int((mb["targets"] != IGNORE_INDEX).sum()) for mb in micro)
            global_tokens = float(env.all_reduce_sum([local])[0])
        scale = env.world_size / max(global_tokens, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        tokens = 0
        for i, mb in enumerate(micro):
            sync = i == len(micro) - 1
            measure = self.activation_bytes is None and i == 0  # once: the first micro-step
            meter = metrics.SavedTensorMeter(model) if measure else contextlib.nullcontext()
            with (contextlib.nullcontext() if sync else strategies.no_grad_sync(model)), meter:
                self.progress.at(self.step + 1, "forward", i)
                s, n = self._loss(mb)
                loss = s * scale
                if measure:
                    self.activation_bytes = meter.bytes
                self.progress.at(self.step + 1, "backward", i)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += s.detach().double()
            tokens += n
        self.progress.at(self.step + 1, "optimizer")
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
        clip = self.cfg.optim.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        if self.grads_bytes is None:
            self.grads_bytes = strategies.local_bytes(p.grad for p in model.parameters())
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum), float(tokens), float(norm)

    def _loss(self, mb: dict, model: Optional[nn.Module] = None) -> tuple[torch.Tensor, int]:
        """(sum of token losses, number of counted tokens) for one micro-batch."""
        dev = self.env.device
        idx = mb["input_ids"].to(dev, non_blocking=True)  # (B, T)
        targets = mb["targets"].to(dev, non_blocking=True)  # (B, T)
        mask = mb.get("attention_mask")
        mask = mask.to(dev, non_blocking=True) if mask is not None else None
        with precision.autocast(self.cfg.trainer.precision, dev, self.fsdp):
            logits = (model or self.model)(idx, attention_mask=mask)  # (B, T, V)
        s = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                            ignore_index=IGNORE_INDEX, reduction="sum")
        return s, int((targets != IGNORE_INDEX).sum())

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        """Token-weighted validation loss over every sample once, whatever the world size."""
        from .data import EvalSampler, collate
        env, tr = self.env, self.cfg.trainer
        self.progress.at(self.step, "eval")
        n = len(self.val_ds)
        if tr.eval_samples is not None:
            n = min(n, tr.eval_samples)
        if n == 0:
            return None
        mine = list(EvalSampler(n, env.world_size, env.rank))
        b = self.micro_batch
        n_batches = math.ceil(math.ceil(n / env.world_size) / b)  # the same on every rank
        was_training = self.model.training
        self.model.eval()
        total = count = 0.0
        for i in range(n_batches):
            idx = mine[i * b:(i + 1) * b]
            if idx:
                s, c = self._loss(collate([self.val_ds[j] for j in idx]))
            else:  # out of samples: keep step with the other ranks, count nothing
                dummy = collate([self.val_ds[0]])
                dummy["targets"].fill_(IGNORE_INDEX)
                s, c = self._loss(dummy)
            total += float(s)
            count += c
        self.model.train(was_training)
        return env.weighted_mean(total, count)


def _loader(ds: Any, sampler: Any, batch_size: int, cfg: TrainConfig, env: DistEnv
            ) -> DataLoader:
    from .data import collate
    workers = cfg.data.num_workers
    # A generator of its own: by default every new iterator draws a seed from the global RNG,
    # and a resumed run starts its iterator mid-epoch, which would shift dropout's random stream.
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=True,
                      collate_fn=collate, num_workers=workers, persistent_workers=workers > 0,
                      pin_memory=env.device.type == "cuda",
                      generator=torch.Generator().manual_seed(cfg.trainer.seed))


def _dot_value(v: Any) -> str:
    """A Python value as OmegaConf's dotlist parser reads it back."""
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_dot_value(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
