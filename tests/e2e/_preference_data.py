"""Tiny local models and preference data, made offline in a second: a "pretrained" causal Llama
and a T5 (random weights saved with save_pretrained, hidden size 32) with a byte-level BPE
tokenizer trained on the test's own sentences, and synthetic preference pairs whose chosen
responses share a property the rejected ones lack (they mention KEYWORD)."""

from __future__ import annotations

import random
from pathlib import Path

from tests.conftest import make_hf_llama, make_hf_tokenizer
from tests.e2e._tiny_model import write_jsonl  # noqa: F401 (one home; imported from here too)

WORDS = ("the a red blue green small big cat dog bird runs sits sees eats near under over "
         "house tree river stone quick slow old new").split()
KEYWORD = "apple"  # every chosen response mentions it, no rejected one does
OTHER = "pebble"  # what the rejected response says in its place


def preference_rows(n: int, seed: int) -> list[dict]:
    """{"prompt", "chosen", "rejected"}: the two responses are the same random words with
    KEYWORD (chosen) or OTHER (rejected) put in at the same random place."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = "Say: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        at = rng.randrange(len(words) + 1)
        chosen = words[:at] + [KEYWORD] + words[at:]
        rejected = words[:at] + [OTHER] + words[at:]
        rows.append({"prompt": prompt, "chosen": " " + " ".join(chosen),
                     "rejected": " " + " ".join(rejected)})
    return rows


def _texts() -> list[str]:
    return [r["prompt"] + r["chosen"] + r["rejected"] for r in preference_rows(300, 99)]


def make_tiny_llama(out: Path, seed: int = 0) -> Path:
    """A LlamaForCausalLM folder (hidden 32, 2 layers, fp32 safetensors) with its tokenizer."""
    return make_hf_llama(out, _texts(), vocab_size=320, hidden_size=32, max_positions=128,
                         seed=seed)


def make_tiny_t5(out: Path, seed: int = 0) -> Path:
    """A T5ForConditionalGeneration folder (d_model 32, 2 + 2 blocks) with a BPE tokenizer that
    has a pad token (T5 starts decoding from it) and EOS."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration
    make_hf_tokenizer(out, _texts(), vocab_size=320, bos=False, pad=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    torch.manual_seed(seed)
    config = T5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      decoder_start_token_id=tok.pad_token_id)
    T5ForConditionalGeneration(config).save_pretrained(out, safe_serialization=True)
    return out
