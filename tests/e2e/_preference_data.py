"""Tiny local models and preference data, made offline in a second: a "pretrained" causal Llama
and a T5 (random weights saved with save_pretrained, hidden size 32) with a byte-level BPE
tokenizer trained on the test's own sentences, and synthetic preference pairs whose chosen
responses share a property the rejected ones lack (they mention KEYWORD)."""

from __future__ import annotations

import random
from pathlib import Path

from tests.conftest import QUIET_RECORDS, make_hf_llama, make_hf_tokenizer
from tests.e2e._tiny_model import write_jsonl

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


def labelled_rows(n: int, seed: int) -> list[dict]:
    """{"text", "label"}: texts that mention KEYWORD ("fruit") or OTHER ("stone"), alternating.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 5))]
        words.insert(rng.randrange(len(words) + 1), KEYWORD if i % 2 else OTHER)
        rows.append({"text": " ".join(words), "label": "fruit" if i % 2 else "stone"})
    return rows


N_VAL = 41  # odd: split over 2 workers and batches, every pair must still count once


def write_preference_data(folder: Path) -> tuple[Path, Path]:
    """train.jsonl (256 pairs) and val.jsonl (N_VAL pairs) in `folder`."""
    return (write_jsonl(folder / "train.jsonl", preference_rows(256, 0)),
            write_jsonl(folder / "val.jsonl", preference_rows(N_VAL, 1)))


def small_run_args(model: Path, train: Path, val: Path, run_dir: Path, **extra) -> list[str]:
    """`paratrain train` overrides for a 10-step fine-tune of a tiny model on 2 workers (batch
    4 per worker, 8 global, a loss every step), then `extra` (data.format among them)."""
    base = {"model.arch": "hf", "model.path": str(model), "data.source": str(train),
            "data.val_source": str(val), "data.max_length": 64, "trainer.devices": "cpu:2",
            "trainer.batch_size": 4, "trainer.global_batch_size": 8, "trainer.max_steps": 10,
            "trainer.log_every": 1, "trainer.eval_every": 1000, "trainer.progress_bar": "false",
            "optim.lr": 3e-3, "optim.warmup_steps": 0, "distributed.timeout_s": 60,
            **QUIET_RECORDS, "run.dir": str(run_dir), **extra}
    return ["train"] + [f"{k}={v}" for k, v in base.items()]


def _texts() -> list[str]:
    return [r["prompt"] + r["chosen"] + r["rejected"] for r in preference_rows(300, 99)]


def make_preference_llama(out: Path, seed: int = 0) -> Path:
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


def make_tiny_bert(out: Path, seed: int = 0) -> Path:
    """A BertModel folder (hidden 32, 2 layers, its pooler saved as BERT checkpoints have it, no
    dropout: runs on 1 and 2 workers compare within 1e-5) with a byte-level BPE tokenizer that
    has a pad token, made offline like the Llama."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel
    make_hf_tokenizer(out, _texts(), vocab_size=320, bos=True, pad=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        pad_token_id=tok.pad_token_id)
    BertModel(config).save_pretrained(out, safe_serialization=True)
    return out
