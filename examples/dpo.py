"""Preference training of a pretrained Hugging Face causal LM with DPO (or a reward model), on 2
workers.

    python examples/dpo.py MODEL_DIR [--pairs 400] [--steps 60] [--devices cpu:2] [--lora 8]
                           [--objective dpo|reward] [--strategy fsdp]

MODEL_DIR is a local `from_pretrained` folder with its tokenizer (nothing is downloaded); to make
one here: `paratrain train` (any run), then `paratrain checkpoint export runs/<name> MODEL_DIR
--format hf`. The pairs come from the standard library: the prompt is a function's signature,
the chosen response the first line of its own docstring, the rejected one another function's.
With LoRA the reference is the model with its adapters switched off (no second copy).
"""

from __future__ import annotations

import argparse
import random

from paratrain import Trainer
from paratrain.data.stdlib_pairs import stdlib_pairs


def preference_pairs(n: int, seed: int = 0) -> list[dict]:
    rows = stdlib_pairs(n)
    others = [r["output"] for r in rows]
    random.Random(seed).shuffle(others)
    return [{"prompt": r["input"], "chosen": r["output"], "rejected": other}
            for r, other in zip(rows, others) if other != r["output"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--pairs", type=int, default=400)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--devices", default="cpu:2")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--lora", type=int, default=8, help="LoRA rank; 0: full fine-tuning")
    p.add_argument("--objective", default="dpo", choices=["dpo", "reward"])
    p.add_argument("--run-dir", default="runs/dpo")
    args = p.parse_args()

    pairs = preference_pairs(args.pairs)
    n_val = max(1, len(pairs) // 10)
    train, val = pairs[n_val:], pairs[:n_val]
    result = Trainer(
        model=args.model_dir, objective=args.objective,
        train_prompts=[r["prompt"] for r in train], train_chosen=[r["chosen"] for r in train],
        train_rejected=[r["rejected"] for r in train],
        validation_prompts=[r["prompt"] for r in val],
        validation_chosen=[r["chosen"] for r in val],
        validation_rejected=[r["rejected"] for r in val],
        devices=args.devices, strategy=args.strategy, max_steps=args.steps, batch_size=4,
        global_batch_size=16, lr=1e-3, warmup_steps=5, log_every=10, run_dir=args.run_dir,
        overwrite=True, overrides=[f"model.lora.r={args.lora}", "data.max_length=96"]).fit()
    s = result.summary
    print(f"final loss {result.final_loss:.4f}, validation loss {result.val_loss:.4f}, "
          f"reward accuracy {s['val_accuracy']:.3f}, reward margin "
          f"{s['val_rewards/margin']:.4f}; model: {result.run_dir}/model")


if __name__ == "__main__":  # workers re-import this file: fit() only under the guard
    main()
