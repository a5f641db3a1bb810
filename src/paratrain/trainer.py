"""Trainer.fit(): check everything, plan the run once, start the workers, return the result.

`fit()` is where a user's mistakes are caught (before a single process starts) and where the
three ways of running meet: in this process (one device), as workers started here through torch's
elastic agent (several devices, several nodes), or as one rank started by torchrun / Slurm.
The run plan (runplan.py) is made here and handed to the workers; one rank's run is rank.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from torch import nn

from .checkpoint.rundir import check_run_dir, hold_run_dir
from .config import registry
from .config.checks import attention_heads
from .config.keywords import dot_value, unknown_keyword
from .config.tree import TrainConfig
from .dist import DistEnv, restart_attempt
from .errors import ConfigError, Interrupted
from .launch import environment, forkserver
from .launch.nodes import join_nodes
from .launch.preemption import await_stop_signal, requeue_slurm_job
from .launch.worker import exit_after_result, own_session
from .parallel.dims import check_context_parallel, check_tensor_parallel
from .parallel.strategies import processes_per_node
from .records.console import log
from .records.timeline import Timeline
from .runplan import RunPlan, auto_choice, check_elastic_batch, check_elastic_layout, \
    make_plan
from .runtime.rank import prepare_task, run_rank
from .tasks.base import Task, TaskRecords, check_picklable
from .tasks.user import UserTask

ELASTIC_RESTARTS = 3  # failures (a node lost) an elastic job survives when max_restarts is 0


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
    `loss_fn` the model must return its loss. Or fine-tune a pretrained Hugging Face model, given
    as its local directory, on input->output pairs (the loss counts the outputs only):

        Trainer(model="path/to/hf_model", train_input=[...], train_output=[...],
                validation_input=[...], validation_output=[...], devices="cpu:2").fit()

    (`train_data=` may instead be a .jsonl / .parquet / .csv path, or a list of
    {"input", "output"} or {"messages"} records.) `task="classify"` trains a text classifier
    instead (AutoModelForSequenceClassification): train_input= the texts, train_output= their
    labels (strings or ints), or {"text", "label"} records. Preference pairs train DPO (or a
    reward model with objective="reward"): train_prompts=, train_chosen=, train_rejected= (and
    validation_prompts=, ...), or {"prompt", "chosen", "rejected"} records. Prompt records
    ({"prompt"}) train online RL (GRPO; objective="ppo": PPO) with
    `reward_functions=[f, ...]`, each `f(prompts, completions) -> list[float]` at a module's top
    level, and the `rl.*` keys by name (num_generations=, max_new_tokens=, beta=, ...). `task=`
    may also be a Task object of your own (tasks/base.py: the model, data, loss, frozen models
    and how to save), trained as it is. Keyword arguments set `trainer.*`
    and `optim.*` keys by name (devices=, strategy=, batch_size=, lr=, ...; optim.name is
    `optimizer=`), plus `shuffle=`, `drop_last=` (data.*), `run_dir=`, `run_name=`,
    `overwrite=`; `distributed_config={...}` sets `distributed.*`; `overrides=[...]` takes
    dotted keys."""

    def __init__(self, cfg: Optional[TrainConfig] = None, *, overrides: Sequence[str] = (),
                 model: Optional[Callable[[], nn.Module]] = None, train_data: Any = None,
                 val_data: Any = None, loss_fn: Optional[Callable] = None,
                 collate_fn: Optional[Callable] = None, fsdp_wrap: Sequence[type] = (),
                 distributed_config: Optional[dict] = None,
                 train_input: Optional[Sequence[str]] = None,
                 train_output: Optional[Sequence[str]] = None,
                 validation_input: Optional[Sequence[str]] = None,
                 validation_output: Optional[Sequence[str]] = None,
                 train_prompts: Optional[Sequence[str]] = None,
                 train_chosen: Optional[Sequence[str]] = None,
                 train_rejected: Optional[Sequence[str]] = None,
                 validation_prompts: Optional[Sequence[str]] = None,
                 validation_chosen: Optional[Sequence[str]] = None,
                 validation_rejected: Optional[Sequence[str]] = None,
                 task: Union[str, Task, None] = None,
                 reward_functions: Optional[Sequence[Union[Callable, str]]] = None,
                 **kwargs: Any):
        finetune: list[str] = []
        self.given: Union[Task, TaskRecords, None] = None
        if task is not None and not isinstance(task, str):  # a Task object of the user's own
            if model is not None or train_data is not None:
                raise ConfigError("task= a Task object brings its own model and data: leave "
                                  "model= and train_data= out")
            if not isinstance(task, Task):  # the loop reads the contract's defaults from it
                raise ConfigError(f"task= must be a paratrain.Task (or UserTask) subclass; "
                                  f"{type(task).__name__} is not one")
            self.given, finetune = task, ["run.name=custom"]
        elif isinstance(model, (str, Path)) and train_prompts is not None:  # preference lists
            from .tasks.preference.pairs import rows_from_preference_lists
            train = rows_from_preference_lists(train_prompts, train_chosen or [],
                                               train_rejected or [])
            val = rows_from_preference_lists(validation_prompts, validation_chosen or [],
                                             validation_rejected or [], what="validation") \
                if validation_prompts is not None else None
            self.given, finetune = _finetune_records(str(model), train, val, None, None, None,
                                                     None, task=task or "preference")
        elif isinstance(model, (str, Path)):  # a pretrained Hugging Face model directory
            self.given, finetune = _finetune_records(
                str(model), train_data, val_data, train_input, train_output, validation_input,
                validation_output, task=task)
        elif task is not None:
            raise ConfigError(f"task={task!r} applies to a pretrained model: pass model= its "
                              "local directory")
        elif (model is None) != (train_data is None):
            raise ConfigError("pass model= (a factory returning an nn.Module) and train_data= (a "
                              "map-style dataset) together, or neither")
        if reward_functions is not None:  # by name: the workers import them
            from .tasks.rl.rewards import reward_name
            finetune.append("rl.reward_functions=" + dot_value(
                [f if isinstance(f, str) else reward_name(f) for f in reward_functions]))
        if cfg is None:
            cfg = TrainConfig.from_yaml(None, finetune or (["run.name=custom"]
                                                           if model is not None else []))
        elif finetune:
            cfg = cfg.with_overrides(finetune)
        sections = {**{k: "trainer" for k in TrainConfig().trainer.__dataclass_fields__},
                    **{k: "optim" for k in TrainConfig().optim.__dataclass_fields__},
                    **{k: "rl" for k in TrainConfig().rl.__dataclass_fields__},
                    "run_dir": "run.dir", "run_name": "run.name", "overwrite": "run.overwrite",
                    "optimizer": "optim.name", "shuffle": "data.shuffle",
                    "drop_last": "data.drop_last"}
        del sections["name"]  # optim.name is optimizer=: name= would read as the run's
        dotted = list(overrides)
        for k, v in kwargs.items():
            if k not in sections:
                raise ConfigError(unknown_keyword(k, v, sorted(sections)))
            key = sections[k] if "." in sections[k] else f"{sections[k]}.{k}"
            dotted.append(f"{key}={dot_value(v)}")
        for k, v in (distributed_config or {}).items():
            dotted.append(f"distributed.{k}={dot_value(v)}")
        self.cfg = cfg.with_overrides(dotted) if dotted else cfg
        if self.given is None and model is not None and not isinstance(model, (str, Path)):
            self.given = UserTask(model, train_data, val_data, loss_fn, collate_fn,
                                  tuple(fsdp_wrap))

    def fit(self) -> RunResult:
        """Train; a stop signal (Ctrl-C, SIGTERM, SIGUSR1) raises `errors.Interrupted` once a
        snapshot is committed, after requeueing the Slurm job when `distributed.requeue`."""
        cfg = self.cfg
        launcher = environment.detect_launcher()
        job_id = environment.slurm_job_id()
        if cfg.distributed.requeue and job_id is None:
            raise ConfigError("distributed.requeue=true requeues a Slurm job, but this is not one "
                              "(SLURM_JOB_ID is not set); submit with sbatch, or drop the key")
        first = launcher.rank == 0 if launcher is not None else cfg.distributed.node_rank == 0
        try:
            with hold_run_dir(cfg.run_dir) if first else contextlib.nullcontext():
                return self._fit(cfg, launcher)
        except Interrupted:
            if cfg.distributed.requeue and first and job_id is not None:
                log(DistEnv(), requeue_slurm_job(job_id))
            raise

    def _fit(self, cfg: TrainConfig, launcher: Optional[environment.LauncherEnv]) -> RunResult:
        if launcher is not None:  # torchrun / Slurm started us: we are one rank; it plans itself
            env = environment.worker_dist_env(launcher, cfg.trainer.devices,
                                              cfg.distributed.backend,
                                         cfg.distributed.timeout_s)
            return _result(run_rank(cfg, dataclasses.replace(env, attempt=restart_attempt()),
                                    given=self.given))
        timeline = Timeline.of_this_process()  # where the start-up goes (summary.json)
        timeline.mark("launcher_imports")
        devices = environment.parse_devices(cfg.trainer.devices)
        d = cfg.distributed
        # Everything a user can get wrong is checked here, before a single worker starts.
        if isinstance(self.given, UserTask):
            u = self.given
            check_picklable(model=u.model_factory, train_data=u.train_ds, val_data=u.val_ds,
                            loss_fn=u.loss_fn, collate_fn=u.collate_fn)
        elif self.given is not None and not isinstance(self.given, TaskRecords):
            check_picklable(task=self.given)
        if cfg.format_line:  # what data.format=auto chose, from which fields
            log(DistEnv(), cfg.format_line)
        if d.node_rank == 0:  # only node 0 writes outputs
            note = check_run_dir(cfg)
            if note:
                log(DistEnv(), note)
        nproc = processes_per_node(cfg.trainer.strategy, len(devices))
        check_tensor_parallel(cfg.trainer.tensor_parallel, world=nproc * d.min_nodes,
                              local_world=nproc, shard_group=cfg.trainer.shard_group_size,
                              heads=() if isinstance(self.given, UserTask) else
                              attention_heads(cfg))
        check_context_parallel(cfg.trainer.context_parallel, world=nproc * d.min_nodes,
                               tp=cfg.trainer.tensor_parallel,
                               pp=cfg.trainer.pipeline_parallel)
        if d.elastic:  # every world size the range allows must give the same global batch,
            check_elastic_batch(cfg.trainer.batch_size, cfg.trainer.global_batch_size, nproc,
                                d.min_nodes, d.max_nodes)  # and the same pipeline stages
            check_elastic_layout(cfg.trainer.pipeline_parallel, cfg.trainer.tensor_parallel,
                                 nproc, d.min_nodes, d.max_nodes, cp=cfg.trainer.context_parallel)
        if nproc == 1 and d.max_nodes == 1:  # one process: train right here
            env = DistEnv.single(devices[0])
            task = prepare_task(cfg, env, self.given)
            plan = make_plan(cfg, task, devices=devices, world_size=1, local_world_size=1)
            timeline.mark("launcher_data")
            return _result(run_rank(cfg, env, plan, task, timeline))
        forkserver.start(cfg)  # (the CLI opened it already: nothing to do)
        with join_nodes(d.master_addr, d.master_port, d.max_nodes, d.node_rank, nproc,
                        d.timeout_s, config=cfg.to_dict(), rdzv=d.rdzv,
                        min_nodes=d.min_nodes) as nodes:
            node_env = DistEnv(node_rank=d.node_rank)  # logs on node 0 only
            task = _prepare_on_nodes(cfg, nodes, node_env, self.given)
            if d.elastic:  # the world size is each round's: its ranks plan it (rank 0 decides)
                restarts = d.max_restarts or ELASTIC_RESTARTS
                log(node_env, f"elastic: {d.min_nodes} to {d.max_nodes} nodes; a node that "
                              f"leaves or joins restarts the job from its last snapshot (up to "
                              f"{restarts} failures)")
                timeline.mark("launcher_data")
                results = nodes.launch(worker_entry, (cfg, None, self.given, timeline),
                                       max_restarts=restarts, grace_s=d.timeout_s)
            else:
                world = nproc * d.max_nodes
                choice = nodes.decided_by_node0("plan", lambda: auto_choice(
                    cfg, task, world_size=world, device=devices[0], local_world_size=nproc))
                plan = make_plan(cfg, task, devices=devices, world_size=world,
                                 local_world_size=nproc, choice=choice,
                                 ranks_on_host=nodes.ranks_on_host)
                timeline.mark("launcher_data")
                results = nodes.launch(worker_entry, (cfg, plan, self.given, timeline),
                                       max_restarts=d.max_restarts, grace_s=d.timeout_s)
        stopped = [r["stopped_by"] for r in results.values() if r.get("stopped_by")]
        if stopped:  # a stop signal reached a worker, not us: the job stopped all the same
            raise Interrupted(stopped[0])
        return _result(results[min(results)])


def _prepare_on_nodes(cfg: TrainConfig, nodes: Any, env: DistEnv,
                      given: Union[Task, TaskRecords, None]) -> Task:
    """The task on every node. A token cache in a folder every node sees is prepared by all of
    them at once, each its part (data/node_share.py); then, as for any other data, node 0
    goes first: a cache in a shared folder is built once and reused by the others, a node
    with a folder of its own builds its own copy."""
    if given is None and cfg.task_spec.load().reads_corpus \
            and nodes.nnodes > 1 and not cfg.distributed.elastic:
        from .data.cache import prepare_data
        share = nodes.data_share(cfg.cache_dir)
        if share.splits:
            prepare_data(cfg.corpus_data, cfg.cache_dir, log=lambda m: log(env, m),
                         packed=cfg.task_spec.packed, nodes=share)
        else:
            log(env, share.line(cfg.cache_dir))
    return nodes.first_then_others("data", lambda: prepare_task(cfg, env, given))


def worker_entry(cfg: TrainConfig, plan: Optional[RunPlan],
                 given: Union[Task, TaskRecords, None] = None,
                 timeline: Optional[Timeline] = None) -> dict:
    """One worker started by the elastic agent (pickled by name, so it lives at module level).
    `plan` None: an elastic round, whose ranks plan for the world size they found. `timeline`:
    the launcher's start-up, which this worker goes on marking."""
    from torch.distributed.elastic.multiprocessing.errors import record
    own_session()  # a scheduler share of its own on a busy machine, as torchrun's workers get
    try:
        out = record(_worker_main)(cfg, plan, given,
                                   timeline.continued_in_worker() if timeline else None)
    except KeyboardInterrupt:  # a second stop signal (Ctrl-C); the rank has cleaned
        import os  # up (finally blocks ran): leave now, not after joining a snapshot thread
        import sys  # or a slow interpreter shutdown; the launcher says where it stopped
        sys.stderr.flush()
        os._exit(130)
    if out.get("stopped_by"):
        # The agent reads a returned value at once while it waits for the run, and never when
        # it is itself stopping the workers (a node joining, its own shutdown): then leave
        # after a moment instead of waiting to be killed. The value is in the pipe already.
        # A second Ctrl-C from here on ends this finished worker quietly.
        import os
        import signal
        import threading
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))
        timer = threading.Timer(2.0, os._exit, (0,))
        timer.daemon = True  # never what keeps the process alive
        timer.start()
    else:
        exit_after_result()  # the value is all the launcher waits for: no slow teardown
    return out


def _worker_main(cfg: TrainConfig, plan: Optional[RunPlan],
                 given: Union[Task, TaskRecords, None], timeline: Optional[Timeline]) -> dict:
    launcher = environment.detect_launcher()
    assert launcher is not None, "worker_entry runs under the elastic agent"
    env = environment.worker_dist_env(launcher, cfg.trainer.devices, cfg.distributed.backend,
                                 cfg.distributed.timeout_s,
                                 devices=list(plan.devices) if plan is not None else None)
    out = run_rank(cfg, dataclasses.replace(env, attempt=restart_attempt()), plan, given,
                   timeline)
    if cfg.distributed.elastic and out.get("stopped_by") and not out.get("signalled_here"):
        # Another node's signal stopped this rank: most often that node's agent restarting its
        # workers because a node joined. Returning at once would tell this node's agent the job
        # is done, and it would wait at the exit barrier for nodes that go on without it: give
        # the agent a moment to see the newcomer and stop this worker itself. (A stop meant for
        # the other node alone finds no newcomer: the job then ends on every node, as before.)
        await_stop_signal(PEER_STOP_WAIT_S)
    return out


# How long a rank stopped by another node's signal waits for its own agent to stop it.
PEER_STOP_WAIT_S = 10.0


def _result(out: dict) -> RunResult:
    if out.get("stopped_by"):
        raise Interrupted(out["stopped_by"])
    s = out["summary"]
    return RunResult(run_dir=Path(out["run_dir"]), final_loss=s.get("final_loss"),
                     val_loss=s.get("val_loss"), steps=s.get("steps", 0), summary=s,
                     is_master=out["is_master"])


def _finetune_records(model_dir: str, train_data: Any, val_data: Any, *lists: Any,
                      task: Optional[str] = None) -> tuple[Optional[TaskRecords], list[str]]:
    """Trainer(model="DIR", ...): (the records to send to the workers, or None when they are
    read from data.source; the config overrides that say so). `task`: a registered fine-tuning
    task (data.format); None: pairs, or the task whose fields the records hold."""
    from .config.formats import format_keys
    from .data.rows import read_rows, rows_from_lists
    tuning = registry.names(pretrained=True)
    if task is not None and task not in tuning:
        raise ConfigError(f"task={task!r} is not one of: {', '.join(tuning)} (or leave it out: "
                          "pairs, or chat for records with messages)")
    default = registry.DEFAULT_RECORDS
    train_input, train_output, val_input, val_output = lists
    over = ["model.arch=hf", f"model.path={model_dir}"]  # run.name: <model folder>-<task>
    if train_input is not None or train_output is not None:
        fields = registry.get(task or default).record_fields
        fields = fields if len(fields) == 2 else registry.get(default).record_fields
        train = rows_from_lists(train_input or [], train_output or [], *fields, what="train")
        val = rows_from_lists(val_input or [], val_output or [], *fields, what="validation") \
            if val_input is not None or val_output is not None else None
        return TaskRecords(train, val), over + [f"data.format={task or default}"]
    if train_data is None:
        raise ConfigError("Trainer(model=DIR) fine-tunes on train_input=[...] and "
                          "train_output=[...], or train_data= (a .jsonl / .parquet / .csv path "
                          "or a list of records)")
    if isinstance(train_data, (str, Path)):
        over += [f"data.source={train_data}"] + ([f"data.val_source={val_data}"]
                                                 if isinstance(val_data, (str, Path)) else [])
        return None, over + [f"data.format={task or default}"]
    train = read_rows(train_data, what="train_data")
    val = read_rows(val_data, what="val_data") if val_data is not None else None
    first = train[0] if train and isinstance(train[0], dict) else {}
    recognised = None if task else format_keys(train)  # ShareGPT, Alpaca, TRL's: their keys
    if recognised:
        return TaskRecords(train, val), over + recognised
    kind = task or registry.recognize(first).name
    return TaskRecords(train, val), over + [f"data.format={kind}"]
