"""The same fine-tune as benchmarks/startup.py gives paratrain, written the way a Hugging Face user
writes it: transformers' Trainer under `torchrun --nproc_per_node=2`, fp32, DDP on gloo.

    torchrun --nproc_per_node=2 benchmarks/hf_trainer_finetune.py MODEL_DIR TRAIN.jsonl OUT_DIR \
        --steps 60 --batch-size 8 --max-length 64

Each pair becomes [BOS] + input + output + EOS, each part tokenized on its own, the input cut from
the left to fit max_length, the loss on the output and EOS only (paratrain's data.format=pairs
with data.chat_template=none). Rank 0 writes OUT_DIR/timeline.json: the wall-clock time (Unix
seconds) of each phase's end, so startup.py can break the command down the same way for both.
"""

import time

T_START = time.time()  # the interpreter has started and is running this file

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

T_IMPORTS = time.time()


def encode(rows, tokenizer, max_length):
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompts = tokenizer([r["input"] for r in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r["output"] for r in rows], add_special_tokens=False)["input_ids"]
    out = []
    for p, a in zip(prompts, answers):
        a = a + [tokenizer.eos_token_id]
        room = max_length - len(bos) - len(a)
        if room < 0:
            continue
        p = p[max(0, len(p) - room):]
        ids = bos + p + a
        out.append({"input_ids": ids, "labels": [-100] * (len(bos) + len(p)) + a})
    return out


def collate(pad_id):
    def fn(batch):
        T = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), T), pad_id)
        labels = torch.full((len(batch), T), -100)
        mask = torch.zeros((len(batch), T), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            labels[i, :n] = torch.tensor(b["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return fn


class Marks(TrainerCallback):
    def __init__(self):
        self.first_step = self.last_step = None
        self.losses = []

    def on_step_end(self, args, state, control, **kw):
        now = time.time()
        if self.first_step is None:
            self.first_step = now
        self.last_step = now

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("train")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=64)
    a = p.parse_args()
    rank = int(os.environ.get("RANK", 0))
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with open(a.train) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    data = encode(rows, tokenizer, a.max_length)
    t_data = time.time()
    model = AutoModelForCausalLM.from_pretrained(a.model, local_files_only=True)
    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=a.batch_size, max_steps=a.steps,
        learning_rate=2e-3, warmup_steps=5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        max_grad_norm=1.0, lr_scheduler_type="cosine", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, seed=1337,
        disable_tqdm=True, remove_unused_columns=False)
    marks = Marks()
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=collate(tokenizer.pad_token_id), callbacks=[marks])
    t_model = time.time()
    trainer.train()
    trainer.save_model(os.path.join(a.out, "model"))
    if rank == 0:
        timeline = {"worker_start": T_START, "worker_imports": T_IMPORTS, "worker_data": t_data,
                    "model_ready": t_model, "first_step": marks.first_step,
                    "last_step": marks.last_step, "saved": time.time(), "losses": marks.losses}
        with open(os.path.join(a.out, "timeline.json"), "w") as f:
            json.dump(timeline, f)


if __name__ == "__main__":
    main()
