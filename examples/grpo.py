"""Online RL with GRPO from the Python API: a pretrained Hugging Face causal LM samples
completions of each prompt, a rule reward scores them, and it learns from its own samples.

    python examples/grpo.py MODEL_DIR [--steps 30] [--devices cpu:2] [--lora 0] [--beta 0.0]

MODEL_DIR is a local `from_pretrained` folder with its tokenizer (nothing is downloaded); to make
one here: `paratrain train` (any run), then `paratrain checkpoint export runs/<name> MODEL_DIR
--format hf`. The prompts are function signatures from the standard library; the reward is the
share of a completion's characters that are digits (any rule works: a function of the prompts
and completions, defined at the top level of the script or a module, returning one float each).
"""

from __future__ import annotations

import argparse
import json

from paratrain import Trainer
from paratrain.data.stdlib_pairs import stdlib_pairs


def digits(prompts: list, completions: list[str]) -> list[float]:
    """The share of each completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--devices", default="cpu:2")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank; 0: full fine-tuning")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient to the reference")
    p.add_argument("--run-dir", default="runs/grpo")
    args = p.parse_args()

    prompts = [{"prompt": r["input"]} for r in stdlib_pairs(200)]
    result = Trainer(
        model=args.model_dir, train_data=prompts, reward_functions=[digits],
        num_generations=4, max_new_tokens=16, beta=args.beta,
        devices=args.devices, max_steps=args.steps, batch_size=2, global_batch_size=4,
        lr=3e-3, warmup_steps=0, schedule="constant", log_every=5, run_dir=args.run_dir,
        overwrite=True, overrides=[f"model.lora.r={args.lora}"]).fit()
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    first, last = json.loads(lines[0]), json.loads(lines[-1])
    print(f"mean reward {first['reward']:.3f} at step {first['step']}, {last['reward']:.3f} at "
          f"step {last['step']}; model: {result.run_dir}/model")


if __name__ == "__main__":
    main()
