"""summary.json: what a finished rank's run did, how fast, with what, and the memory of every
rank, in one dict (written by rank 0, returned to Trainer.fit as RunResult.summary)."""

from __future__ import annotations

import math
from typing import Any, Optional

from ..config.hub import hub_model
from ..redact import redact_url

def run_summary(run: Any, last: dict, val_loss: Optional[float], memory: list,
                wall_s: float) -> dict:
    """summary.json of a rank.RankRun (passed in: rank.py imports this module): what the run did, how fast, with what, and the memory of every rank."""
    plan, env, task, resumed = run.plan, run.env, run.task, run.resumed
    cfg, step, figures, best = plan.cfg, run.loop.state.step, run.loop.figures, run.loop.state.best
    return {
        "steps": step, "epochs": step / plan.steps_per_epoch,
        "final_loss": last.get("loss"), "val_loss": val_loss,
        "final_reward": last.get("reward"),  # online RL: the last log line's mean reward
        "val_perplexity": math.exp(min(val_loss, 700))  # of a per-token cross-entropy only
        if val_loss is not None and task.unit_name == "tokens" else None,
        "wall_s": wall_s, "train_s": figures.train_s,
        # loss units: tokens for language models (the documented name), texts for a classifier
        "tokens_per_s": figures.units / max(figures.train_s, 1e-9), "tokens": figures.units,
        "loss_unit": task.unit_name,
        "data_wait_s": figures.data_wait_s, "step_times_s": figures.step_times,
        "step_cpu_s": figures.step_cpu_times,
        "world_size": env.world_size, "nnodes": env.nnodes, "world_history": run.world_history,
        "strategy": plan.strategy,
        "strategy_reason": plan.parallelism_reason,
        "tensor_parallel": plan.dims.tp, "pipeline_parallel": plan.dims.pp,
        "parallel_dims": plan.dims.to_dict(),
        "activation_checkpointing": plan.activation_checkpointing,
        "cpu_offload": plan.parallelism.offloads_to_host,
        "precision": plan.precision, "batch_size": cfg.trainer.batch_size,
        "grad_accum": plan.accum, "global_batch_size": plan.global_batch,
        "seq_length": cfg.data.seq_length, "params": run.n_params,
        # fine-tuning: the share of computed tokens that are pads (data/packing.py); None else
        "padding_share": task.padding_share,
        "resumed_from": None if resumed is None else {
            "step": resumed.step, "path": redact_url(resumed.url),
            "world_size": resumed.world_size},
        "snapshots": run.snapshots.report(),
        "data_fingerprint": task.data_fingerprint, "memory": memory,
        "best_val_loss": best.best_loss, "best_step": best.best_step,
        "stopped_early": run.loop.stopped_early,
        "hub_model": hub_model(cfg.model.path) if cfg.model.arch == "hf" else None,
    }
