"""Where the first minute of a command goes: paratrain's own launcher, paratrain under torchrun, and
Hugging Face's Trainer under torchrun, on the same tiny fine-tune; and the default pretraining job
under paratrain's launcher and under torchrun. Interleaved (A B C, then C B A, ...) so that the
machine's drifting load falls on every variant alike; the 1-minute load average is recorded
before and after every run.

    python benchmarks/startup.py --repeats 3             # results in benchmarks/results/startup
    python benchmarks/startup.py --variants paratrain,hf # a subset

Phases of one command (seconds): `launcher` (the launching process's imports, data preparation
and the start of the workers, up to a worker process existing), `worker_imports`, `data`,
`model` (process group, model built, optimizer; HF: its Trainer set up), `first_step`,
`to_first_step` (the command's start to the end of its first optimizer step), `teardown` (the end
of the last step to the command's exit), `wall`, and `cpu` (CPU seconds the whole machine spent while the
command ran, from /proc/stat: every process of the command counts, however it was started — the
workers forked by paratrain's forkserver are not the command's waited-for children — and so does
whatever else ran, which an idle machine keeps small). paratrain's come from summary.json's
`timeline`, HF's from the timeline its script writes (hf_trainer_finetune.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--nproc_per_node=2"]
FINETUNE = {"model.arch": "hf", "data.format": "pairs", "data.max_length": 64,
            "data.chat_template": "none", "data.val_fraction": 0, "trainer.devices": "cpu:2",
            "trainer.strategy": "ddp", "trainer.batch_size": 8, "optim.warmup_steps": 5,
            "trainer.progress_bar": "false", "run.overwrite": "true"}
PRETRAIN = {"trainer.max_steps": 5, "trainer.eval_every": 1000, "trainer.eval_samples": 1,
            "trainer.progress_bar": "false", "run.overwrite": "true"}
VARIANTS = ("paratrain", "paratrain-cold", "paratrain-torchrun", "hf", "pretrain",
            "pretrain-torchrun")


def make_fixture(work: Path, pairs: int) -> Path:
    """A tiny Llama (random weights, 165K parameters) with a byte-level BPE tokenizer trained on
    `pairs` stdlib signature -> docstring pairs, saved as a Hugging Face folder; and the pairs."""
    if (work / "model" / "model.safetensors").is_file() and (work / "train.jsonl").is_file():
        return work
    code = f"""
import json, torch, transformers
from pathlib import Path
from tests.conftest import make_hf_tokenizer
from paratrain.data.stdlib_pairs import stdlib_pairs
out = Path({str(work)!r})
rows = stdlib_pairs({pairs})
(out / "train.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
make_hf_tokenizer(out / "model", [r["input"] + " " + r["output"] for r in rows], vocab_size=512)
tok = transformers.AutoTokenizer.from_pretrained(out / "model")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=172,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
transformers.LlamaForCausalLM(cfg).save_pretrained(out / "model")
"""
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([PY, "-c", code], check=True, cwd=REPO, env=_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return work


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO / "src"), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p]))
    return env


def machine_cpu_s() -> float:
    """CPU seconds spent by every core since boot (busy time: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # user nice system idle iowait irq softirq ...
    return busy / os.sysconf("SC_CLK_TCK")


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def command(variant: str, work: Path, run_dir: Path, steps: int) -> list[str]:
    if variant == "hf":
        return TORCHRUN + [str(REPO / "benchmarks" / "hf_trainer_finetune.py"),
                           str(work / "model"), str(work / "train.jsonl"), str(run_dir),
                           "--steps", str(steps), "--batch-size", "8", "--max-length", "64"]
    if variant.startswith("pretrain"):
        keys = {**PRETRAIN, "data.cache_dir": work / "cache", "run.dir": run_dir}
    else:
        cache = work / ("cache-cold" if variant.endswith("cold") else "cache")
        keys = {**FINETUNE, "model.path": work / "model", "data.source": work / "train.jsonl",
                "trainer.max_steps": steps, "data.cache_dir": cache, "run.dir": run_dir}
    launcher = TORCHRUN + ["-m", "paratrain"] if variant.endswith("torchrun") else \
        [PY, "-m", "paratrain"]
    return launcher + ["train"] + [f"{k}={v}" for k, v in keys.items()]


def run_once(variant: str, work: Path, steps: int) -> dict:
    run_dir = work / "runs" / variant
    shutil.rmtree(run_dir, ignore_errors=True)
    if variant.endswith("cold"):
        shutil.rmtree(work / "cache-cold", ignore_errors=True)
    cmd = command(variant, work, run_dir, steps)
    before = load()
    cpu0 = machine_cpu_s()
    t0 = time.time()
    r = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=900)
    end = time.time()
    cpu1 = machine_cpu_s()
    if r.returncode != 0:
        raise SystemExit(f"{variant} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    out = {"variant": variant, "wall": end - t0, "load_before": before, "load_after": load(),
           "cpu": cpu1 - cpu0}
    out.update(phases(variant, run_dir, t0, end))
    return out


def phases(variant: str, run_dir: Path, t0: float, end: float) -> dict:
    """The command's phases (see the module docstring) from the run's own timeline."""
    if variant == "hf":
        t = json.loads((run_dir / "timeline.json").read_text())
        marks = [("launcher", t["worker_start"]), ("worker_imports", t["worker_imports"]),
                 ("data", t["worker_data"]), ("model", t["model_ready"]),
                 ("first_step", t["first_step"])]
        last = t["last_step"]
    else:
        t = json.loads((run_dir / "summary.json").read_text())["timeline"]
        spawned = t.get("spawn", t["start"])  # under torchrun: the worker process's start
        marks = [("launcher", spawned), ("worker_imports", t["imports"]),
                 ("data", t["data"]), ("model", t["records"]), ("first_step", t["first_step"])]
        last = t["last_step"]
    out, before = {}, t0
    for name, at in marks:
        out[name], before = at - before, at
    out["to_first_step"] = marks[-1][1] - t0
    out["teardown"] = end - last
    return out


COLUMNS = ("launcher", "worker_imports", "data", "model", "first_step", "to_first_step",
           "teardown", "wall", "cpu")


def table(runs: list[dict], variants: list[str]) -> str:
    rows = ["| variant | runs | " + " | ".join(COLUMNS) + " | load (1 min) |",
            "|---" * (len(COLUMNS) + 3) + "|"]
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        if not rs:
            continue
        med = {c: statistics.median(r[c] for r in rs) for c in COLUMNS}
        loads = [x for r in rs for x in (r["load_before"], r["load_after"])]
        rows.append(f"| {v} | {len(rs)} | " + " | ".join(f"{med[c]:.1f}" for c in COLUMNS)
                    + f" | {min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(rows)


def ratios(runs: list[dict], a: str, b: str, key: str) -> list[float]:
    """a/b for each interleaved pair (the i-th run of each)."""
    xs = [r[key] for r in runs if r["variant"] == a]
    ys = [r[key] for r in runs if r["variant"] == b]
    return [x / y for x, y in zip(xs, ys)]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/paratrain-startup", help="fixture and run folder")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "startup"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--variants", default="paratrain,paratrain-cold,paratrain-torchrun,hf",
                   help=f"comma-separated, of: {', '.join(VARIANTS)}")
    a = p.parse_args()
    variants = a.variants.split(",")
    work = make_fixture(Path(a.work), a.pairs)
    warm = [v for v in ("paratrain", "pretrain") if any(x.startswith(v) for x in variants)]
    for v in warm:  # the warm caches (encoded records, token cache) exist before timing
        run_once(v, work, 2)
    runs = []
    for i in range(a.repeats):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            runs.append(run_once(v, work, a.steps))
            r = runs[-1]
            print(f"{v:20s} first step {r['to_first_step']:6.1f} s, teardown {r['teardown']:5.1f}"
                  f" s, wall {r['wall']:6.1f} s (load {r['load_before']:.1f} -> "
                  f"{r['load_after']:.1f})", flush=True)
    report = [table(runs, variants)]
    for a_, b_ in (("paratrain", "hf"), ("paratrain-cold", "hf"), ("paratrain-torchrun", "hf"),
                   ("pretrain", "pretrain-torchrun")):
        if a_ in variants and b_ in variants:
            for key in ("to_first_step", "wall"):
                rs = ratios(runs, a_, b_, key)
                report.append(f"{a_} / {b_}, {key}: geometric mean {geomean(rs):.2f} over "
                              f"{len(rs)} pairs ({', '.join(f'{x:.2f}' for x in rs)})")
    text = "\n".join(report)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps({"runs": runs, "report": text}, indent=2))
    print(f"results: {out / 'startup.json'}")


if __name__ == "__main__":
    main()
