"""Sampling from a trained model, nanoGPT style: no KV cache, the whole (cropped) context is
re-encoded every step. Quadratic, but simple and plenty fast for the sizes trained here.

torch is imported inside the function: `models/__init__.py` imports this module eagerly (the
function shares the module's name, so it cannot be lazy there) and must stay torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..errors import ParatrainError

if TYPE_CHECKING:
    import torch
    import torch.nn as nn


@dataclass(frozen=True)
class GenerateOptions:
    """`paratrain generate`'s options, as every task's generate function takes them."""
    run_dir: str
    max_new_tokens: int = 100
    temperature: float = 0.8  # 0: greedy
    top_k: Optional[int] = 50
    seed: int = 0
    device: str = "cpu"
    bos: bool = False  # start with [BOT], as padded-format training saw documents start
    # fine-tuned runs: render the prompt as training rendered inputs (the run's config.yaml)
    system_prompt: Optional[str] = None  # a system turn first (chat template runs)
    chat_template: bool = False  # pairs: the run rendered its pairs with a chat template


def generate_from_run(model_dir: Path, prompt: str, opts: GenerateOptions) -> str:
    """A language model's run (ours, or a Hugging Face model pretrained on a corpus): `prompt`
    and its continuation."""
    import torch

    from .files import load_model
    from .hf import generate_hf, is_hf_folder
    if is_hf_folder(model_dir):
        return generate_hf(model_dir, prompt, opts)
    model, tokenizer = load_model(opts.run_dir, device=opts.device)
    if tokenizer is None:
        raise ParatrainError(f"{opts.run_dir!r} has no tokenizer.json next to the model")
    ids = [tokenizer.bot_id] + tokenizer.encode(prompt) if opts.bos else tokenizer.encode(prompt)
    if not ids:
        raise ParatrainError("--prompt encodes to no tokens; give some text, e.g. --prompt 'def '")
    g = torch.Generator(device=opts.device).manual_seed(opts.seed)
    idx = torch.tensor([ids], dtype=torch.long, device=opts.device)  # (1, T0)
    out = generate(model, idx, opts.max_new_tokens, temperature=opts.temperature,
                   top_k=opts.top_k, eos_id=tokenizer.eot_id, generator=g)
    return tokenizer.decode(out[0].tolist())


def generate(model: "nn.Module", idx: "torch.Tensor", max_new_tokens: int,
             temperature: float = 1.0, top_k: Optional[int] = None, eos_id: Optional[int] = None,
             generator: Optional["torch.Generator"] = None) -> "torch.Tensor":
    """Append up to `max_new_tokens` sampled tokens to each row of `idx` (B, T0).

    temperature 0 means greedy (argmax). Once a row has produced `eos_id` it keeps receiving
    eos_id (so rows stay the same length), and sampling stops when every row has. The model
    is put in eval mode for the call (no dropout) and its mode is restored afterwards.
    """
    import torch

    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    max_len = model.args.max_seq_length
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # (B,)
            for _ in range(max_new_tokens):
                logits = model(idx[:, -max_len:])[:, -1, :].float()  # (B, V)
                next_id = _sample(logits, temperature, top_k, generator)  # (B, 1)
                if eos_id is not None:  # finished rows are padded with eos
                    next_id = next_id.masked_fill(done[:, None], eos_id)
                    done = done | (next_id[:, 0] == eos_id)
                idx = torch.cat((idx, next_id), dim=1)  # (B, T+1)
                if eos_id is not None and bool(done.all()):
                    break
    finally:
        model.train(was_training)
    return idx


def _sample(logits: "torch.Tensor", temperature: float, top_k: Optional[int],
            generator: Optional["torch.Generator"]) -> "torch.Tensor":
    """(B, V) logits -> (B, 1) token ids."""
    import torch

    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator)  # (B, 1)
