"""minGPT on characters: a char-level tokenizer and a GPT with learned positions, trained with
data parallelism on any text file (default: a module of the Python standard library).

    python examples/mingpt_char.py                           # 300 steps on all local devices
    python examples/mingpt_char.py --text book.txt --steps 2000 --devices cpu:2
"""

import argparse
import sysconfig
from pathlib import Path

import torch

from paratrain import TrainConfig, Trainer, load_model
from paratrain.models import generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--devices", default="auto")
    p.add_argument("--run-dir", default="runs/mingpt-char")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prompt", default="def ", help="made of characters the text contains")
    args = p.parse_args()
    cfg = TrainConfig.from_yaml(None, [
        "model.arch=gpt", f"model.preset={args.preset}", "data.tokenizer=char",
        f"data.source={args.text}", "data.seq_length=128", "data.val_fraction=0",
        f"trainer.devices={args.devices}", f"trainer.max_steps={args.steps}",
        "trainer.batch_size=16", "optim.lr=3e-3", f"run.dir={args.run_dir}",
        "run.overwrite=true"])
    result = Trainer(cfg).fit()
    if result.is_master:
        model, tok = load_model(result.run_dir)
        prompt = torch.tensor([tok.encode(args.prompt)])  # (1, T0)
        out = generate(model, prompt, 100, temperature=0.8,
                       generator=torch.Generator().manual_seed(0))
        print(f"final loss {result.final_loss:.3f}\n{tok.decode(out[0].tolist())}")


if __name__ == "__main__":
    main()
