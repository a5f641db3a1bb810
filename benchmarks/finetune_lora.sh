#!/usr/bin/env bash
# Full fine-tuning vs LoRA (r=8) of the same 16M HF Llama (a paratrain `medium` exported with
# `checkpoint export --format hf`), 2 CPU workers, DDP, 25 steps; prints step time and memory.
# Expects /tmp/ft/{corpus,train.jsonl,val.jsonl} (tests/e2e/test_finetune.py makes the same).
set -e
cd /tmp/ft
OMP_NUM_THREADS=1 /work/main/.venv/bin/paratrain train model.preset=medium data.source=/tmp/ft/corpus data.vocab_size=4096 data.seq_length=128 data.cache_dir=/tmp/ft/cache trainer.max_steps=1 trainer.devices=cpu:1 trainer.progress_bar=false run.dir=/tmp/ft/med run.overwrite=true log.report=false > /dev/null 2>&1
rm -rf /tmp/ft/medhf; /work/main/.venv/bin/paratrain checkpoint export /tmp/ft/med /tmp/ft/medhf --format hf
for r in 0 8; do
 OMP_NUM_THREADS=1 /work/main/.venv/bin/paratrain train model.arch=hf model.path=/tmp/ft/medhf data.format=pairs data.source=/tmp/ft/train.jsonl data.val_source=/tmp/ft/val.jsonl data.max_length=128 trainer.devices=cpu:2 trainer.strategy=ddp trainer.max_steps=25 trainer.batch_size=4 trainer.global_batch_size=16 trainer.log_every=5 trainer.progress_bar=false model.lora.r=$r run.dir=/tmp/ft/bench-r$r run.overwrite=true log.report=false trainer.eval_samples=16 > /tmp/ft/bench-r$r.log 2>&1
done
uptime
/work/main/.venv/bin/python - <<'PY'
import json, statistics
for r in (0, 8):
    s = json.load(open(f"/tmp/ft/bench-r{r}/summary.json"))
    st = s["step_times_s"][5:]
    m = s["memory"][0]
    print(f"lora r={r}: params {s['params']:,}; median step {statistics.median(st):.3f} s; "
          f"params {m['params_bytes']/2**20:.1f} MB grads {m['grads_bytes']/2**20:.2f} MB optim {m['optimizer_bytes']/2**20:.2f} MB peak {m['peak_bytes']/2**20:.0f} MB; tokens/s {s['tokens_per_s']:.0f}")
PY
