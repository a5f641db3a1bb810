"""paratrain's packed fine-tune against TRL 1.16's SFTTrainer with its packing, on the data and
the tiny Llama of benchmarks/packing.py (run that first: it writes them to --out), one epoch each
on 2 CPU workers (paratrain: trainer.devices=cpu:2; TRL: `torchrun --nproc_per_node=2`, DDP on
gloo, `use_cpu=True`), interleaved, with the load average before and after each run.

    python benchmarks/packing.py --out /tmp/packing-bench --rounds 1     # the data, the model
    python benchmarks/packing_trl.py --out /tmp/packing-bench [--rounds 2]

TRL: SFTConfig(packing=True, packing_strategy="bfd", max_length=2048), which turns padding_free
on: each micro-batch of packed rows is flattened into one sequence with position ids restarting
per example and no attention mask; the model is loaded as TRL loads it (attention "sdpa" on the
CPU). The same optimisation as paratrain's defaults (AdamW, betas 0.9 / 0.95, weight decay 0.1,
lr 3e-3 with 5 warm-up steps then cosine to lr / 10, gradient norm clipped at 1), 2 rows of 2,048
tokens per worker, fp32, seed 0. The held-out loss of both final models is computed here by one
function (`heldout_loss`: the 100 held-out pairs encoded as paratrain's data.format=pairs does,
the token-weighted mean cross-entropy of the outputs and EOS), and paratrain's own val_loss is
printed beside it. `leak_check` says whether TRL's packed batch keeps examples apart on the CPU:
three held-out examples through TRL's own collator (padding_free), each example's logits against
the example alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from packing import load  # this folder

PARATRAIN = ["model.arch=hf", "data.format=pairs", "data.max_length=2048", "data.pack=true",
             "trainer.devices=cpu:2", "trainer.batch_size=2", "trainer.max_steps=null",
             "trainer.epochs=1", "trainer.eval_every=100000", "trainer.log_every=10",
             "trainer.progress_bar=false", "optim.lr=3e-3", "optim.warmup_steps=5",
             "trainer.seed=0"]


def trl_worker(out: Path, run_dir: Path) -> None:
    """One TRL process (under torchrun): SFTTrainer with bfd packing, one epoch; rank 0 writes
    run_dir/trl.json (train_runtime, steps) and the final model to run_dir/model."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    torch.set_num_threads(1)
    model_dir = out / "tiny-llama"
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    data = load_dataset("json", data_files=str(out / "train.jsonl"), split="train")
    data = data.map(lambda r: {"prompt": r["input"], "completion": r["output"]},
                    remove_columns=["input", "output"])
    args = SFTConfig(
        output_dir=str(run_dir), packing=True, packing_strategy="bfd", max_length=2048,
        per_device_train_batch_size=2, gradient_accumulation_steps=1, num_train_epochs=1,
        learning_rate=3e-3, warmup_steps=5, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": 3e-4}, adam_beta1=0.9, adam_beta2=0.95,
        weight_decay=0.1, max_grad_norm=1.0, seed=0, data_seed=0, use_cpu=True,
        ddp_backend="gloo", dataloader_num_workers=0, report_to=[], save_strategy="no",
        logging_steps=10, eval_strategy="no", bf16=False, fp16=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    result = trainer.train()
    if trainer.is_world_process_zero():
        trainer.save_model(str(run_dir / "model"))
        (run_dir / "trl.json").write_text(json.dumps({
            "train_s": result.metrics["train_runtime"], "steps": result.global_step,
            "attn": model.config._attn_implementation,
            "padding_free": trainer.padding_free}))


def heldout_loss(model_dir: Path, tokenizer_dir: Path, val: Path) -> float:
    """The token-weighted mean cross-entropy of the held-out outputs (and EOS), each pair alone:
    input + output + EOS, each part tokenized on its own (paratrain's data.format=pairs)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for line in val.read_text().splitlines():
            row = json.loads(line)
            prompt = tok(row["input"], add_special_tokens=False)["input_ids"]
            answer = tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([(prompt + answer)[-2048:]])  # (1, L)
            logits = model(ids).logits[0, :-1].float()  # (L-1, V)
            targets = ids[0, 1:].clone()  # (L-1,)
            targets[: max(0, ids.shape[1] - len(answer) - 1)] = -100
            total += float(F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"))
            count += int((targets != -100).sum())
    return total / count


def leak_check(out: Path) -> dict:
    """Three held-out examples through TRL's collator (padding_free, as its bfd packing runs) and
    the model as TRL loads it on the CPU: the largest difference of an example's logits packed
    vs alone (a leak across examples shows as a difference far above float rounding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    tok = AutoTokenizer.from_pretrained(out / "tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(out / "tiny-llama", dtype=torch.float32).eval()
    rows = [json.loads(x) for x in (out / "val.jsonl").read_text().splitlines()[:3]]
    seqs = [tok(r["input"] + r["output"])["input_ids"][:300] for r in rows]
    collate = DataCollatorForLanguageModeling(pad_token_id=tok.eos_token_id, padding_free=True)
    batch = collate([{"input_ids": s} for s in seqs])
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
            "max_length_k")
    with torch.no_grad():
        inputs = {k: batch[k] for k in keys if k in batch}
        inputs["use_cache"] = False  # as SFTTrainer.compute_loss sets it
        packed = model(**inputs).logits[0]  # (sum L, V)
        worst, at = 0.0, 0
        for s in seqs:
            alone = model(torch.tensor([s])).logits[0]  # (L, V)
            worst = max(worst, float((packed[at:at + len(s)] - alone).abs().max()))
            at += len(s)
    return {"attn_implementation": model.config._attn_implementation,
            "collator_keys": sorted(batch), "max_abs_logit_diff": worst,
            "leaks": worst > 1e-4}


def timed(args: list[str], tool: str) -> tuple[float, float]:
    """(wall seconds, the load average before) of one command, which must succeed."""
    before, t0 = load(), time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{r.stderr[-3000:]}")
    return wall, before


def run_paratrain(out: Path, k: int) -> dict:
    run_dir = out / "runs" / f"paratrain-packed-{k}"
    args = [sys.executable, "-m", "paratrain", "train", *PARATRAIN,
            f"model.path={out / 'tiny-llama'}", f"data.source={out / 'train.jsonl'}",
            f"data.val_source={out / 'val.jsonl'}", f"data.cache_dir={out / 'cache'}",
            f"run.dir={run_dir}"]
    wall, before = timed(args, "paratrain")
    s = json.loads((run_dir / "summary.json").read_text())
    return {"tool": "paratrain packed", "round": k, "command_s": round(wall, 1),
            "train_s": round(s["train_s"], 1), "steps": s["steps"],
            "own_val_loss": s["val_loss"], "load_before": before, "load_after": load(),
            "heldout_loss": heldout_loss(run_dir / "model", out / "tiny-llama",
                                         out / "val.jsonl")}


def run_trl(out: Path, k: int) -> dict:
    run_dir = out / "runs" / f"trl-packed-{k}"
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--master_port=29533", __file__, "--out", str(out), "--worker", str(run_dir)]
    wall, before = timed(args, "TRL")
    s = json.loads((run_dir / "trl.json").read_text())
    return {"tool": "TRL SFTTrainer packed", "round": k, "command_s": round(wall, 1),
            "train_s": round(s["train_s"], 1), "steps": s["steps"], "attn": s["attn"],
            "padding_free": s["padding_free"], "load_before": before, "load_after": load(),
            "heldout_loss": heldout_loss(run_dir / "model", out / "tiny-llama",
                                         out / "val.jsonl")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/packing-bench")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # torchrun's processes
    args = p.parse_args()
    out = Path(args.out)
    if args.worker:
        return trl_worker(out, Path(args.worker))
    if not (out / "tiny-llama" / "model.safetensors").is_file():
        raise SystemExit(f"{out} holds no data: run benchmarks/packing.py --out {out} first")
    print(json.dumps({"leak_check": leak_check(out), "cores": os.cpu_count(), "load": load()}),
          flush=True)
    results = []
    for k in range(args.rounds):
        for fn in (run_paratrain, run_trl):
            results.append(fn(out, k))
            print(json.dumps(results[-1]), flush=True)
    med = {t: statistics.median(r["train_s"] for r in results if r["tool"] == t)
           for t in {r["tool"] for r in results}}
    print(json.dumps({"train_s_median": med}))
    (out / "results_trl.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
