"""`paratrain` on the command line. A user error is one line on stderr and exit code 2; a crash
inside paratrain keeps its traceback (that one is ours to fix)."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from . import checkpoint
from ..errors import ParatrainError

if TYPE_CHECKING:
    from ..config.tree import TrainConfig

USAGE_EXIT = 2


def _split_config_args(args: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """`[CONFIG.yaml] [key=value ...]`: the first argument without '=' is the config file."""
    path: Optional[str] = None
    overrides: List[str] = []
    for i, a in enumerate(args):
        if "=" not in a and i == 0:
            path = a
        else:
            overrides.append(a)
    return path, overrides


def cmd_train(ns: argparse.Namespace) -> int:
    from ..config.tree import TrainConfig
    path, overrides = _split_config_args(ns.args)
    cfg = TrainConfig.from_yaml(path, overrides)  # a bad key fails here, before torch loads
    if (os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0") == "0":
        # torch and the rest take seconds to import, minutes on a busy machine: say we live
        print(f"[paratrain] config checked ({cfg.run.name}); loading torch", file=sys.stderr,
              flush=True)
    from ..launch import forkserver
    forkserver.start_for(cfg)  # the workers' imports begin now, beside ours
    from ..trainer import Trainer
    try:
        result = Trainer(cfg).fit()
    except KeyboardInterrupt as e:  # Ctrl-C, or a stop signal (errors.Interrupted)
        import signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends us at once
        from ..checkpoint.rundir import stopped_message
        from ..launch.preemption import signal_name
        signum = getattr(e, "signum", signal.SIGINT)
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}"
        if (os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0") == "0":
            # (under torchrun / Slurm every rank is a CLI: the line comes from rank 0 only)
            print(f"paratrain: {how} {stopped_message(cfg)}", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        forkserver.stop()  # nothing more to launch (its own exit would hold our output pipes)
    if result.is_master:
        s = result.summary
        online_rl = "val_reward" in s or s.get("final_reward") is not None  # loss: -reward
        named = [("final reward", s.get("final_reward")),
                 ("validation reward", s.get("val_reward"))] if online_rl else [
            ("final loss", result.final_loss), ("validation loss", result.val_loss),
            ("accuracy", s.get("val_accuracy"))]
        figures = [f"{name} {value:.4f}" for name, value in named
                   if value is not None]  # (no loss: resumed at the end)
        print(", ".join(figures) + f"; run dir: {result.run_dir}")
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    """What the run's task does with a prompt (registry: continue it, answer it, label it)."""
    import torch

    from ..config import registry
    from ..launch.environment import cpu_count
    from ..models.files import model_dir_of
    from ..models.generate import GenerateOptions
    from ..config.hub import resolve_folder
    from ..runplan import thread_share
    # as a one-process training run sets them: OMP_NUM_THREADS when set, else one per core this
    # process may use (2 OpenMP threads where 1 was asked for spin on a busy 2-core machine)
    torch.set_num_threads(thread_share(cpu_count(), 1, os.environ.get("OMP_NUM_THREADS"))[
        "cpu_threads"])
    ns.run_dir = resolve_folder(ns.run_dir, None, "RUN_DIR")  # a Hub id: its cached snapshot
    data, trainer = _run_sections(ns.run_dir)
    opts = GenerateOptions(
        run_dir=ns.run_dir, max_new_tokens=ns.max_new_tokens, temperature=ns.temperature,
        top_k=ns.top_k or None, seed=ns.seed, bos=ns.bos,
        device=ns.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        system_prompt=data.get("system_prompt") if ns.system_prompt is None
        else ns.system_prompt or None,
        chat_template=data.get("chat_template", "none") != "none")
    model_dir = model_dir_of(ns.run_dir)
    fmt = data.get("format") or "packed"
    spec = registry.recorded(fmt, trainer.get("objective") or "auto",
                             key=f"{ns.run_dir}'s data.format")
    print(spec.generator()(model_dir, ns.prompt, opts))
    return 0


def _run_sections(run_dir: str) -> Tuple[dict, dict]:
    """The run's data.* and trainer.* keys from its config.yaml ({} for a bare model/ folder:
    a language model's)."""
    from pathlib import Path

    from omegaconf import OmegaConf
    cfg_file = Path(run_dir) / "config.yaml"
    if not cfg_file.is_file():
        return {}, {}
    cfg = OmegaConf.to_container(OmegaConf.load(cfg_file))
    return cfg.get("data", {}), cfg.get("trainer", {})  # type: ignore[union-attr]


def cmd_bench(ns: argparse.Namespace) -> int:
    from ..tools.bench import run_bench
    path, overrides = _split_config_args(ns.args)
    report = run_bench(path, overrides, scaling=ns.scaling,
                       rows=ns.rows.split(",") if ns.rows else None, steps=ns.steps,
                       warmup=ns.warmup, repeats=ns.repeats, out=ns.out,
                       peak_tflops=ns.peak_tflops)
    print(report["table"])
    print(report["plot_note"] or f"chart: {report['plot']}")
    print(f"results: {report['json']}")
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    import json

    from ..config.tree import TrainConfig
    from ..parallel.memory_estimate import estimates_for_config, format_estimates
    path, overrides = _split_config_args(ns.args)
    cfg = TrainConfig.from_yaml(path, overrides)
    task = _plan_task(cfg)
    share = None if task is None else task.padding_share
    if task is not None and task.memory_probe() is None:  # the padding alone: said, no table
        from ..data.packing import padding_line
        print(json.dumps({"padding_share": share}) if ns.json else
              f"{padding_line(share, cfg.data.pack)}\nmemory: paratrain plan cannot measure "
              f"data.format={cfg.data.format}'s model yet (trainer.strategy=auto picks ddp)")
        return 0
    if at_scale(cfg):  # a target layout, or tensor parallelism: simulate the parallelized model
        from ..parallel.simulate import format_simulation, simulate_at_scale
        rows, target, pick, work = simulate_at_scale(cfg)
        capacity = target.capacity
        text = format_simulation(rows, target, pick, work, cfg.model.preset or cfg.model.arch)
    else:  # this machine: measure activations with a real forward on the CPU
        probe = None if task is None else task.memory_probe()
        rows, capacity, pick = estimates_for_config(cfg, probe=probe)
        text = format_estimates(rows, capacity, pick)
    if share is not None:
        from ..data.packing import padding_line
        text += f"\n{padding_line(share, cfg.data.pack)}"
    if ns.json:
        print(json.dumps({"rows": [r.to_dict() for r in rows], "capacity_bytes": capacity,
                          "auto": {"strategy": pick.label, "why": pick.why},
                          "padding_share": share}, indent=2))
    else:
        print(text)
    return 0


def _plan_task(cfg: "TrainConfig") -> Any:
    """A fine-tuning task, prepared as a run would (its memory probe, its padding share); None:
    the config's own model (model.arch llama/gpt) on a corpus."""
    if not cfg.task_spec.pretrained:
        return None
    from ..dist import DistEnv
    from ..runtime.rank import prepare_task
    return prepare_task(cfg, DistEnv(), quiet=True)


def at_scale(cfg) -> bool:
    """Whether `paratrain plan` simulates (a plan.* target, tensor, pipeline or context
    parallelism)."""
    p = cfg.plan
    return bool(p.nodes or p.devices_per_node or p.device_memory_gb
                or cfg.trainer.tensor_parallel > 1 or cfg.trainer.pipeline_parallel > 1
                or cfg.trainer.context_parallel > 1)


def cmd_config_show(ns: argparse.Namespace) -> int:
    from ..config.docs import annotated_yaml
    from ..config.tree import TrainConfig
    from ..redact import redact_secrets
    path, overrides = _split_config_args(ns.args)
    values = redact_secrets(TrainConfig.from_yaml(path, overrides).to_dict())
    print(annotated_yaml(TrainConfig, values, everything=ns.all), end="")
    return 0


def cmd_report(ns: argparse.Namespace) -> int:
    from ..records.report import write_report
    print(f"wrote {write_report(ns.run_dir, ns.out)}")
    return 0


def cmd_doctor(ns: argparse.Namespace) -> int:
    from ..tools import doctor
    return doctor.run(ns)


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", default="auto", help="as trainer.devices (default: auto)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0,
                   help="0: a free port (one node only); set it, the same on every node, for more")
    p.add_argument("--max-mb", type=float, default=64.0, help="largest all-reduce (MiB)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="for the rendezvous and each collective (default 60)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paratrain",
        description="Train PyTorch language models on many devices with data parallelism.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    t = sub.add_parser("train", help="train a model (no arguments: the default job)",
                       description="Train. With no arguments: a small Llama on the Python "
                                   "standard library's source, on all local devices.")
    t.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]",
                   help="a YAML config and/or dotted overrides such as trainer.max_steps=100")
    t.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("run_dir", help="a run dir (runs/<name>), its model/ folder, or a "
                   "Hub id (org/name) of a causal LM, read through the Hugging Face cache")
    g.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=50, help="0 means no top-k filtering")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if present)")
    g.add_argument("--bos", action="store_true",
                   help="start with [BOT], as padded-format training saw documents start")
    g.add_argument("--system-prompt", default=None,
                   help="fine-tuned runs with a chat template: the system turn (default: the "
                        "run's data.system_prompt; '' for none)")
    g.set_defaults(func=cmd_generate)

    pl = sub.add_parser("plan", help="memory per device for each strategy, and auto's pick",
                        description="Predict parameter, gradient, optimizer and activation bytes "
                                    "per device for single/ddp/fsdp/fsdp+ac/fsdp+offload at the "
                                    "configured world size, precision, batch and sequence length. "
                                    "With plan.nodes / plan.devices_per_node / "
                                    "plan.device_memory_gb (or trainer.tensor_parallel), simulate "
                                    "that layout instead: the real parallelized model on the meta "
                                    "device under a fake process group, tensor-parallel layouts "
                                    "included, with the bytes each device sends per step.")
    pl.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.set_defaults(func=cmd_plan)

    c = sub.add_parser("config", help="show the resolved configuration")
    csub = c.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    cs = csub.add_parser("show", help="print the resolved config as YAML, each key described",
                         description="The resolved configuration (defaults, then CONFIG.yaml, "
                                     "then the overrides) as YAML, each key with its "
                                     "description as a comment: the common keys and those "
                                     "set to other than their default, or with --all every "
                                     "key.")
    cs.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    cs.add_argument("--all", action="store_true", help="every key, not only the common ones")
    cs.set_defaults(func=cmd_config_show)

    dr = sub.add_parser("doctor", help="environment, devices, master address, an all-reduce and "
                                       "send/recv",
                        description="Versions, devices, backends, env vars, master address and "
                                    "port; then an all-reduce over the local devices (and nodes "
                                    "with --nnodes) with bus bandwidth as nccl-tests reports it, "
                                    "and send/recv between neighbouring ranks (pipeline stages).")
    _doctor_arguments(dr)
    dr.set_defaults(func=cmd_doctor)

    checkpoint.add_commands(sub)

    _add_report_and_bench(sub)
    return p


def _add_report_and_bench(sub: Any) -> None:
    """The commands that draw and time: `report`, `bench`."""
    rp = sub.add_parser("report", help="draw report.png for a finished or running run",
                        description="Loss and validation loss, tokens/s and learning rate "
                                    "against steps (metrics.jsonl), and memory per rank "
                                    "(summary.json), as RUN_DIR/report.png.")
    rp.add_argument("run_dir", help="a run dir (runs/<name>)")
    rp.add_argument("--out", default=None, help="write here instead of RUN_DIR/report.png")
    rp.set_defaults(func=cmd_report)

    bp = sub.add_parser("bench", help="strategies side by side, against a plain PyTorch loop",
                        description="Time the configured model under each strategy and under a "
                                    "hand-written DDP loop (interleaved runs, median step after "
                                    "warm-up); write bench.json and bench.png.")
    bp.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    bp.add_argument("--scaling", action="store_true",
                    help="1 worker vs all workers, same per-device batch: weak-scaling efficiency")
    bp.add_argument("--rows", default=None,
                    help="comma-separated rows to run (default: all of "
                         "single,dp,ddp,fsdp,fsdp+ac,tp,fsdp+tp2,plain; tp: tensor parallel "
                         "over every device; also pp,pp-gpipe,pp-interleaved: a pipeline of "
                         "every device)")
    bp.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    bp.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    bp.add_argument("--repeats", type=int, default=2, help="interleaved repeats (default 2)")
    bp.add_argument("--out", default=None, help="output folder (default: <run dir>/bench)")
    bp.add_argument("--peak-tflops", type=float, default=None,
                    help="peak TFLOP/s per GPU for MFU (default: from the GPU's name)")
    bp.set_defaults(func=cmd_bench)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except ParatrainError as e:
        print(f"paratrain: error: {e}", file=sys.stderr)
        return USAGE_EXIT
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The `paratrain` command: `main()`, then leave without the interpreter's module teardown,
    which frees every module of torch (and transformers): 0.6 s of an idle CPU after the result
    is printed, many seconds on a busy one, and under torchrun in every rank. Python first joins
    the threads that are not daemons and runs every atexit hook (a logger's own included); the
    hook that ends the process is registered first, so it runs last."""
    from ..launch.worker import exit_now
    outcome = {"code": 1}  # an uncaught exception's (its traceback is printed by then)
    atexit.register(lambda: exit_now(outcome["code"]))
    try:
        outcome["code"] = main()
    except SystemExit as e:  # argparse's own exits: --help (0), a usage error (2)
        outcome["code"] = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    sys.exit(outcome["code"])


if __name__ == "__main__":  # pragma: no cover
    run()
