"""Llama pretraining with paratrain: the classic hand-written DDP/FSDP pretraining script
(process group, sampler, rank checks, checkpoints, launch) in a few lines.

    python examples/llama_pretrain.py                                  # the default job
    python examples/llama_pretrain.py model.preset=medium trainer.max_steps=1000 \\
        checkpoint.every_steps=100 trainer.strategy=fsdp
    torchrun --nproc_per_node=4 examples/llama_pretrain.py trainer.devices=[0,1,2,3]

Arguments are config overrides (`paratrain config show` lists every key), optionally after a
YAML file.
"""

import sys

import torch

from paratrain import TrainConfig, Trainer, load_model
from paratrain.models import generate


def main(argv: list[str]) -> None:
    path = argv[0] if argv and "=" not in argv[0] else None
    cfg = TrainConfig.from_yaml(path, argv[1:] if path else argv)
    result = Trainer(cfg).fit()  # launches one worker per device, or is one rank under torchrun
    if not result.is_master:
        return
    print(f"final loss {result.final_loss:.4f}, validation loss {result.val_loss:.4f}")
    model, tokenizer = load_model(result.run_dir)
    idx = torch.tensor([tokenizer.encode("def ")])  # (1, T0)
    out = generate(model, idx, max_new_tokens=40, temperature=0.8, top_k=50,
                   generator=torch.Generator().manual_seed(0))
    print(tokenizer.decode(out[0].tolist()))


if __name__ == "__main__":
    main(sys.argv[1:])
