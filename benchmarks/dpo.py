"""DPO step time and memory per rank: full DPO (a frozen reference copy in memory, or its
log-probs precomputed) vs LoRA (the reference is the model with its adapters off, or
precomputed). 2 CPU workers, DDP, a Llama made here from a transformers config (hidden 256,
4 layers) with a BPE tokenizer trained on the pairs, offline.

    python benchmarks/dpo.py [--out /tmp/dpo-bench] [--steps 20]

Pairs: the standard library's functions (signature -> its docstring's first line, preferred over
another function's), as examples/dpo.py makes them. Prints one row per variant: median step
(wall) and CPU time per step of rank 0 after 5 warm-up steps, and rank 0's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "full, reference copy": [],
    "full, precomputed": ["dpo.precompute_reference=true"],
    "LoRA r=8, adapters off": ["model.lora.r=8"],
    "LoRA r=8, precomputed": ["model.lora.r=8", "dpo.precompute_reference=true"],
}


def make_model(out: Path, texts: list[str], *, vocab: int = 4096, hidden: int = 256,
               intermediate: int = 688, layers: int = 4, kv_heads: int = 4,
               positions: int = 256) -> Path:
    """A Llama of these sizes with a BPE tokenizer trained on `texts`, saved to `out` as a
    from_pretrained folder (kept when it is there): the benchmarks' local base model."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    if (out / "model.safetensors").is_file():
        return out
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab, show_progress=False, special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=hf, eos_token="</s>")
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=positions,
                         eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/dpo-bench")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from dpo import preference_pairs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = preference_pairs(600)
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs[40:]))
    (out / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs[:40]))
    model = make_model(out / "model", [r["prompt"] + r["chosen"] for r in pairs])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for name, extra in VARIANTS.items():
        run = out / name.replace(" ", "").replace(",", "-").replace("=", "")
        cmd = [sys.executable, "-m", "paratrain", "train", "model.arch=hf",
               f"model.path={model}", "data.format=preference", f"data.source={out}/train.jsonl",
               f"data.val_source={out}/val.jsonl", "data.max_length=128",
               "trainer.devices=cpu:2", "trainer.strategy=ddp", "trainer.batch_size=4",
               "trainer.global_batch_size=16", f"trainer.max_steps={args.steps}",
               "trainer.log_every=5", "trainer.progress_bar=false", "trainer.eval_samples=16",
               "optim.lr=1e-4", "optim.min_lr=1e-5", f"data.cache_dir={out}/cache",
               f"run.dir={run}", "run.overwrite=true", "log.report=false", *extra]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
        s = json.loads((run / "summary.json").read_text())
        m = s["memory"][0]
        mb = {k: m.get(k, 0) / 2**20 for k in ("params_bytes", "frozen_bytes", "grads_bytes",
                                                "optimizer_bytes", "peak_bytes")}
        rows.append(f"| {name} | {statistics.median(s['step_times_s'][5:]):.3f} s | "
                    f"{statistics.median(s['step_cpu_s'][5:]):.3f} s | "
                    f"{mb['params_bytes']:.1f} MB | {mb['frozen_bytes']:.1f} MB | "
                    f"{mb['grads_bytes']:.2f} MB | {mb['optimizer_bytes']:.2f} MB | "
                    f"{mb['peak_bytes']:.0f} MB |")
    print(f"{s['params']:,} parameters; load average {os.getloadavg()[0]:.1f}")
    print("| | median step | CPU / step (rank 0) | params / rank | reference / rank | "
          "grads / rank | optimizer / rank | peak RSS / rank |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
