"""Your own model and data with paratrain: a small convolutional classifier on generated images.

    python examples/custom_model.py                       # 2 CPU workers (or all GPUs), DDP
    python examples/custom_model.py --strategy fsdp --steps 100

Everything handed to Trainer is defined at module level: the workers are separate processes
(spawned), so the model *factory* (not a built model), the dataset, the collate and the loss are
pickled and sent to them. The factory runs inside each worker, so nothing large crosses over.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from paratrain import Trainer


class Stripes(Dataset):
    """16x16 grey images: class 0 has horizontal stripes, class 1 vertical ones, plus noise.
    Generated from a seed per index, so every worker sees the same sample for the same index."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = i % 2
        period = int(torch.randint(2, 5, (1,), generator=g))
        line = (torch.arange(16) // period % 2).float()  # (16,)
        img = line[:, None].expand(16, 16) if label == 0 else line[None, :].expand(16, 16)
        img = img + 0.5 * torch.randn(16, 16, generator=g)
        return img[None], torch.tensor(label)  # (1, 16, 16), ()


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)


class SmallCNN(nn.Module):
    def __init__(self, width: int = 16, classes: int = 2):
        super().__init__()
        self.blocks = nn.Sequential(ConvBlock(1, width), ConvBlock(width, 2 * width))
        self.head = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 16, 16)
        return self.head(self.blocks(x).flatten(1))  # (B, classes)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN()


def classification_loss(logits: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.cross_entropy(logits, batch[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="auto")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp", "single", "auto"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--run-dir", default="runs/custom-cnn")
    args = p.parse_args()
    result = Trainer(model=make_model, train_data=Stripes(2048), val_data=Stripes(256, seed=1),
                     loss_fn=classification_loss, fsdp_wrap=[ConvBlock],
                     devices=args.devices, strategy=args.strategy, max_steps=args.steps,
                     batch_size=16, log_every=10, eval_every=1000, lr=3e-3,
                     run_dir=args.run_dir, overwrite=True).fit()
    print(f"final loss {result.final_loss:.4f}, validation loss {result.val_loss:.4f}; "
          f"model in {result.run_dir}/model/model.safetensors")


if __name__ == "__main__":
    main()
