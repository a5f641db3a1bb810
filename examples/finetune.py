"""Fine-tune a pretrained Hugging Face causal LM on input->output pairs, with LoRA, on 2 workers.

    python examples/finetune.py MODEL_DIR [--pairs 400] [--steps 60] [--devices cpu:2] [--lora 8]

MODEL_DIR is a local `from_pretrained` folder with its tokenizer (nothing is downloaded). To make
one here: `paratrain train` (any run), then `paratrain checkpoint export runs/<name> MODEL_DIR
--format hf`. The data are the standard library's functions: a signature -> the first line of
its docstring; the loss counts only the docstring's tokens.
"""

from __future__ import annotations

import argparse

from paratrain import Trainer
from paratrain.data.stdlib_pairs import stdlib_pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--pairs", type=int, default=400)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--devices", default="cpu:2")
    p.add_argument("--lora", type=int, default=8, help="LoRA rank; 0: full fine-tuning")
    p.add_argument("--run-dir", default="runs/finetune")
    args = p.parse_args()

    pairs = stdlib_pairs(args.pairs)
    n_val = max(1, len(pairs) // 10)
    train, val = pairs[n_val:], pairs[:n_val]
    result = Trainer(
        model=args.model_dir,
        train_input=[r["input"] for r in train], train_output=[r["output"] for r in train],
        validation_input=[r["input"] for r in val], validation_output=[r["output"] for r in val],
        devices=args.devices, max_steps=args.steps, batch_size=4, global_batch_size=16,
        lr=3e-3, warmup_steps=5, log_every=10, run_dir=args.run_dir, overwrite=True,
        overrides=[f"model.lora.r={args.lora}", "data.max_length=64"]).fit()
    print(f"final loss {result.final_loss:.4f}, validation loss {result.val_loss:.4f}; "
          f"model: {result.run_dir}/model" + (f", adapter: {result.run_dir}/adapter"
                                              if args.lora else ""))


if __name__ == "__main__":  # workers re-import this file: fit() only under the guard
    main()
