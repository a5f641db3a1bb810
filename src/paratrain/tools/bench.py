"""`paratrain bench`: the configured model under each strategy, side by side with a plain loop.

Every row is a real run, started the way a user starts one (`python -m paratrain train ...`, and
`torchrun -m paratrain.tools.plain_ddp ...` for the hand-written reference), in its own process so
that peak memory is that run's. Rows are interleaved (A B C A B C) so that drift in a shared
machine's speed lands on every row alike. A row's speed is the median of its per-step wall times
after the warm-up steps, pooled over the repeats: start-up, data preparation, compilation and
the final save are outside the timed window by construction. Compilation shows up as the
first-step time instead.

`--scaling` asks a different question: one worker against N with the same per-device batch;
efficiency = throughput(N) / (N x throughput(1)). On CPU a one-worker run is pinned to the
cores one of the N workers would have, so both sides get the same compute per worker.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..config.tree import TrainConfig
from ..dist import DistEnv
from ..errors import ConfigError, TrainingError
from ..fileio import atomic_write_json
from ..launch import environment
from ..parallel.memory_estimate import candidate_label
from ..parallel.strategies import processes_per_node, resolve_parallelism
from ..parallel.tensor import resolve_tensor_parallel
from .bench_rows import format_table, gpu_peak_flops, paired_ratios, plot, summarize

PLAIN = "plain"
# Each row is a memory-plan candidate, named as the plan names it: (trainer.strategy, recompute,
# trainer.tensor_parallel; 0: every device); `tp` is tensor parallelism over all the devices
# (tp2 on 2 workers), fsdp+tp2 splits layers in pairs and shards over the pairs (4+ workers)
ROW_REQUESTS = {"single": ("single", False, 1), "dp": ("dp", False, 1),
                "ddp": ("ddp", False, 1), "fsdp": ("fsdp", False, 1),
                "fsdp+ac": ("fsdp", True, 1), "tp": ("fsdp", False, 0),
                "fsdp+tp2": ("fsdp", False, 2)}
# Pipeline rows (only when asked for with --rows): P = every device, one row per schedule; each
# carries `ideal_bubble`, the idle fraction of a step of M micro-batches with every forward and
# backward part equally long (parallel/pipeline_schedules.py: (P - 1) / (V x M + P - 1) through
# V stages per process, interleaved: 2; zero-bubble's a third of it)
PIPELINE_ROWS = {"pp": "1f1b", "pp-gpipe": "gpipe", "pp-interleaved": "interleaved-1f1b",
                 "pp-zb": "zero-bubble"}
DEFAULT_ROWS = (*ROW_REQUESTS, PLAIN)
ROWS = (*ROW_REQUESTS, *PIPELINE_ROWS, PLAIN)

@dataclass(frozen=True)
class Variant:
    """One row: a paratrain run (`overrides` on top of the user's) or the plain loop."""
    label: str
    world: int
    overrides: tuple[str, ...] = ()
    plain: bool = False
    cores: Optional[tuple[int, ...]] = None  # CPU affinity for a one-worker CPU run
    ideal_bubble: Optional[float] = None  # a pipeline row's, e.g. 1f1b's (P - 1) / (M + P - 1)


@dataclass
class Bench:
    """Everything a bench needs that does not change between rows."""
    config_path: Optional[str]
    overrides: list[str]
    cfg: TrainConfig
    devices: list[torch.device]
    out: Path
    steps: int
    warmup: int
    repeats: int
    timeout_s: float


# ---- the variants to time --------------------------------------------------------------------
def choose_variants(cfg: TrainConfig, devices: list[torch.device], rows: Sequence[str],
                    scaling: bool) -> tuple[list[Variant], list[dict]]:
    """(variants to run, rows skipped with the reason). The skip reasons are the strategy
    resolver's own messages, so `bench` and `train` never disagree about what is available."""
    n = len(devices)
    one = _one_device(devices)
    cores = _cores_per_worker(devices)
    if scaling:
        if n < 2:
            raise ConfigError("paratrain bench --scaling needs several devices; set "
                              "trainer.devices=cpu:2 or a list of GPUs")
        return [Variant("1 worker", 1, (f"trainer.devices={one}",), cores=cores),
                Variant(f"{n} workers", n, ("trainer.strategy=ddp",))], []
    runs: list[Variant] = []
    skipped: list[dict] = []
    for row in rows:
        if row == PLAIN:
            runs.append(Variant(PLAIN, n, plain=True))
            continue
        if row == "single":
            runs.append(Variant("single", 1, (f"trainer.devices={one}", "trainer.strategy=single"),
                                cores=cores))
            continue
        if row in PIPELINE_ROWS:
            try:
                runs.append(_pipeline_variant(cfg, row, n))
            except ConfigError as e:  # too few blocks, tied embeddings, ...: the train's words
                skipped.append({"label": row, "reason": str(e)})
            continue
        strategy, recompute, tp = ROW_REQUESTS[row]
        tp = tp or n
        world = processes_per_node(strategy, n)
        try:
            if tp > 1:  # also the model's heads: a config error of its own
                cfg.with_overrides([f"trainer.tensor_parallel={tp}"])
                got, why = resolve_tensor_parallel(strategy, tp, world_size=world,
                                                   local_world_size=world, device=devices[0])
            else:
                got, why = resolve_parallelism(strategy, world_size=world,
                                               local_world_size=world, device=devices[0])
        except ConfigError as e:
            skipped.append({"label": row, "reason": str(e)})
            continue
        wanted = f"tp{tp}" if row == "tp" else row
        if candidate_label(got, recompute) != wanted:
            skipped.append({"label": row, "reason": f"{strategy} resolves to {got.label} here "
                                                    f"({why})"})
            continue
        extra = ("trainer.activation_checkpointing=true",) if recompute else ()
        extra += (f"trainer.tensor_parallel={tp}",) if tp > 1 else ()
        # dp is one process driving all n GPUs; the others are n processes
        runs.append(Variant(wanted, n, (f"trainer.strategy={strategy}",) + extra))
    return runs, skipped


def _pipeline_variant(cfg: TrainConfig, row: str, n: int) -> Variant:
    """A pipeline of every device with the row's schedule (a ConfigError when the config's
    model or batch cannot be split so)."""
    from ..parallel.pipeline_schedules import ideal_bubble
    from ..runplan import batch_plan
    schedule = PIPELINE_ROWS[row]
    over = (f"trainer.pipeline_parallel={n}", f"trainer.pipeline_schedule={schedule}",
            "trainer.strategy=auto")
    tr = cfg.with_overrides(list(over)).trainer
    micro, _ = batch_plan(tr.batch_size, 1, tr.global_batch_size)  # one process per stage
    return Variant(row.replace("pp", f"pp{n}", 1), n, over,
                   ideal_bubble=ideal_bubble(schedule, n, micro))


def _one_device(devices: list[torch.device]) -> str:
    d = devices[0]
    return "cpu" if d.type == "cpu" else f"cuda:{d.index or 0}"


def _cores_per_worker(devices: list[torch.device]) -> Optional[tuple[int, ...]]:
    if devices[0].type != "cpu" or not hasattr(os, "sched_getaffinity"):
        return None
    mine = sorted(os.sched_getaffinity(0))
    return tuple(mine[:max(1, len(mine) // len(devices))])


# ---- running one row ---------------------------------------------------------------------------
def run_variant(b: Bench, v: Variant, rep: int) -> dict:
    """Start one run in its own process; return its per-step times and memory."""
    name = f"{v.label.replace(' ', '-').replace('+', '-')}-r{rep}"
    run_dir = b.out / "runs" / name
    log_path = b.out / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_args = ([b.config_path] if b.config_path else []) + list(b.overrides)
    common = [f"trainer.max_steps={b.warmup + b.steps}", "checkpoint.every_steps=0",
              "checkpoint.resume=never"]
    env = {k: v_ for k, v_ in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC",
                                "GROUP_RANK", "LOCAL_WORLD_SIZE"))}
    if v.plain:
        out_json = run_dir / "plain.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        # launched the way paratrain launches (elastic_launch, one session): see plain_ddp.py
        cmd = [sys.executable, "-m", "paratrain.tools.plain_ddp", *cfg_args, *common,
               "--out", str(out_json), f"--nproc={v.world}"]
        if b.devices[0].type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d.index) for d in b.devices[:v.world])
    else:
        cmd = [sys.executable, "-m", "paratrain", "train", *cfg_args, *common, *v.overrides,
               f"run.dir={run_dir}", "run.overwrite=true", "trainer.eval_samples=1",
               f"trainer.eval_every={b.warmup + b.steps + 1}"]
    pin = (lambda: os.sched_setaffinity(0, v.cores)) if v.cores else None
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=pin)
        try:
            rc = proc.wait(timeout=b.timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise TrainingError(f"bench row {v.label!r} did not finish in {b.timeout_s:.0f} s; "
                                f"see {log_path}") from None
        except BaseException:  # Ctrl-C: take the row's workers down with us
            _stop(proc)
            raise
    if rc != 0:
        tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
        raise TrainingError(f"bench row {v.label!r} failed (exit {rc}): "
                            f"{tail[-1] if tail else 'no output'}; full log: {log_path}")
    if v.plain:
        out = json.loads(out_json.read_text())
        return {"step_times_s": out["step_times_s"], "step_cpu_s": out.get("step_cpu_s"),
                "memory": out["memory"],
                "strategy": "plain ddp" if v.world > 1 else "plain", "data_wait_s": None,
                "train_s": sum(out["step_times_s"]), "final_loss": out["final_loss"],
                "tokens_per_step": out["global_batch_size"] * out["seq_length"]}
    s = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir / "model", ignore_errors=True)  # weights of a timing run: not needed
    return {"step_times_s": s["step_times_s"], "step_cpu_s": s.get("step_cpu_s"),
            "memory": s["memory"], "strategy": s["strategy"],
            "data_wait_s": s.get("data_wait_s"), "train_s": s.get("train_s"),
            "final_loss": s.get("final_loss"), "params": s.get("params"),
            "tokens_per_step": s["global_batch_size"] * s["seq_length"]}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM first: torchrun and the elastic agent forward it to their workers (which sit in
    sessions of their own, out of reach of a group kill); SIGKILL what is left after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


# ---- the command -----------------------------------------------------------------------------
def run_bench(config_path: Optional[str], overrides: Sequence[str], *, scaling: bool = False,
              rows: Optional[Sequence[str]] = None, steps: int = 20, warmup: int = 3,
              repeats: int = 2, out: Optional[str] = None, timeout_s: float = 3600.0,
              peak_tflops: Optional[float] = None) -> dict:
    """Run the bench and write bench.json (+ bench.png); returns what bench.json holds."""
    from ..models import flops_per_token
    from ..runplan import batch_plan, steps_per_epoch
    from ..tasks.pretraining import LMTask

    if warmup < 1 or steps < 2 or repeats < 1:
        raise ConfigError(f"--warmup={warmup}, --steps={steps}, --repeats={repeats}: need at "
                          "least 1 warm-up step, 2 timed steps and 1 repeat")
    rows = list(rows or DEFAULT_ROWS)
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ConfigError(f"--rows {','.join(unknown)} not understood; choose from "
                          f"{','.join(ROWS)}")
    if environment.detect_launcher() is not None:
        raise ConfigError("paratrain bench starts its own workers; run it without torchrun/srun")
    overrides = list(overrides)
    if scaling:
        overrides.append("trainer.global_batch_size=null")  # the same per-device batch
    cfg = TrainConfig.from_yaml(config_path, overrides)
    if cfg.distributed.max_nodes > 1:
        raise ConfigError("paratrain bench runs on one node; set distributed.nnodes=1")
    devices = environment.parse_devices(cfg.trainer.devices)
    _, global_batch = batch_plan(cfg.trainer.batch_size, len(devices),
                                 cfg.trainer.global_batch_size)
    variants, skipped = choose_variants(cfg, devices, rows, scaling)
    out_dir = Path(out) if out else cfg.run_dir / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[paratrain] bench: {msg}", file=sys.stderr, flush=True)

    # Data once, here: every row then starts from the cache (and a too-small corpus fails now).
    task = LMTask.prepare(cfg, DistEnv.single(devices[0]), None, say)
    steps_per_epoch(len(task.train_ds), global_batch, task)
    margs = task.args
    b = Bench(config_path, list(overrides), cfg, devices, out_dir, steps, warmup, repeats,
              timeout_s)
    peak = peak_tflops * 1e12 if peak_tflops else gpu_peak_flops(devices[0])
    for s in skipped:
        say(f"{s['label']}: skipped: {s['reason']}")

    results: dict[str, list[dict]] = {v.label: [] for v in variants}
    order = []
    load_at_start = _loadavg()
    t_all = time.perf_counter()
    for rep in range(repeats):  # A B C, A B C: drift hits every row alike
        for v in variants:
            t0 = time.perf_counter()
            r = run_variant(b, v, rep)
            r["load_avg_after"] = _loadavg()  # the machine's load over the run's minute
            results[v.label].append(r)
            order.append(f"{v.label}#{rep}")
            med = statistics.median(r["step_times_s"][warmup:])
            load = f", load {r['load_avg_after'][0]:.1f}" if r["load_avg_after"] else ""
            say(f"{v.label} (repeat {rep + 1}/{repeats}): {med * 1e3:.1f} ms/step median, "
                f"run took {time.perf_counter() - t0:.1f} s{load}")
    fpt = flops_per_token(margs, cfg.data.seq_length)
    table = [summarize(v, results[v.label], warmup, fpt, peak, devices[0].type == "cuda")
             for v in variants]

    report: dict[str, Any] = {
        "mode": "scaling" if scaling else "strategies",
        "config": {"path": config_path, "overrides": list(overrides),
                   "model": margs.to_dict(), "flops_per_token": fpt,
                   "seq_length": cfg.data.seq_length, "batch_size": cfg.trainer.batch_size,
                   "precision": cfg.trainer.precision, "compile": cfg.trainer.compile,
                   "devices": [str(d) for d in devices]},
        "machine": {"torch": torch.__version__, "cpu_count": environment.cpu_count(),
                    "gpu": torch.cuda.get_device_name(devices[0])
                    if devices[0].type == "cuda" else None,
                    "peak_flops_per_device": peak, "load_avg_at_start": load_at_start,
                    "load_avg_at_end": _loadavg(),
                    "load_avg_1min_after_each_run": [r["load_avg_after"][0] if r[
                        "load_avg_after"] else None for rep in range(repeats)
                        for r in (results[v.label][rep] for v in variants)]},
        "method": {"warmup_steps": warmup, "timed_steps_per_run": steps, "repeats": repeats,
                   "order": order, "statistic": "median of per-step wall times after warm-up, "
                   "pooled over repeats; spread = (p90 - p10) / median; cpu_vs_plain = the plain "
                   "loop's median CPU seconds per step (rank 0 process) / this row's"},
        "rows": table, "skipped": skipped, "wall_s": time.perf_counter() - t_all,
    }
    if scaling:
        one, many = table
        eff = many["tokens_per_s"] / (many["world_size"] * one["tokens_per_s"])
        report["scaling"] = {"world_sizes": [1, many["world_size"]], "efficiency": eff}
        for r in table:
            r["vs_plain"] = r["cpu_vs_plain"] = None
        ref = None
    else:
        ref = next((r for r in table if r["label"] == PLAIN), None)
        pairs = paired_ratios(results, PLAIN, warmup) if ref else {}
        for r in table:
            r["vs_plain"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
            r["vs_plain_per_repeat"] = pairs.get(r["label"])
            r["vs_plain_paired_median"] = statistics.median(pairs[r["label"]]) \
                if r["label"] in pairs else None
            r["cpu_vs_plain"] = (ref["step_cpu_median_s"] / r["step_cpu_median_s"]
                                 if ref and ref["step_cpu_median_s"] and r["step_cpu_median_s"]
                                 else None)
    text = format_table(table, "1 worker" if scaling else None)
    if scaling:
        text += f"\nweak scaling efficiency 1 -> {table[1]['world_size']} workers: " \
                f"{report['scaling']['efficiency']:.3f}"
    for r in table:
        if r["ideal_bubble"] is not None:
            text += (f"\n{r['label']}: ideal pipeline bubble (equal forward and backward parts) "
                     f"= {100 * r['ideal_bubble']:.0f}% of a step")
    for r in table:
        if r.get("vs_plain_per_repeat") and r["label"] != PLAIN:
            text += (f"\n{r['label']} vs plain, repeat by repeat (runs side by side): " +
                     " ".join(f"{x:.3f}" for x in r["vs_plain_per_repeat"]) +
                     f"; median {r['vs_plain_paired_median']:.3f}")
    loads = report["machine"]
    if loads["load_avg_at_start"] and loads["load_avg_at_end"]:
        text += (f"\nload average (1 min) at the start {loads['load_avg_at_start'][0]:.2f}, "
                 f"at the end {loads['load_avg_at_end'][0]:.2f} on {environment.cpu_count()} "
                 "cores (above the core count the wall times say little: see cpu ms)")
    for s in skipped:
        text += f"\n{s['label']}: skipped: {s['reason']}"
    params = next((r["params"] for rs in results.values() for r in rs if r.get("params")), 0)
    report["config"]["params"] = params
    title = (f"{margs.arch} {params / 1e6:.1f}M params, seq {cfg.data.seq_length}, batch "
             f"{cfg.trainer.batch_size}/device, {cfg.trainer.precision}, "
             f"{len(devices)} x {devices[0].type}")
    note = plot(table, out_dir / "bench.png", title)
    report["plot"] = None if note else str(out_dir / "bench.png")
    report["plot_note"] = note
    report["table"] = text
    report["json"] = str(out_dir / "bench.json")
    atomic_write_json(out_dir / "bench.json", report)
    return report


def _loadavg() -> Optional[list[float]]:
    try:
        return list(os.getloadavg())
    except OSError:
        return None
