"""A tiny local "pretrained" Hugging Face Llama and input->output pairs, made offline in a second:
the model folder a new user would point model.path at (config, random weights, a byte-level BPE
tokenizer trained on the pairs), for tests that run fine-tuning as a user does."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import make_hf_tokenizer


def make_pairs(n: int, seed: int = 0) -> list[dict]:
    """{"input", "output"} rows from the standard library: a function's signature -> the first
    line of its docstring (real text, deterministic)."""
    from paratrain.data.stdlib_pairs import stdlib_pairs
    rows = stdlib_pairs(n)
    assert len(rows) == n, f"the standard library gave {len(rows)} pairs, not {n}"
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_tiny_llama(out: Path, texts: list[str], max_positions: int = 256, seed: int = 0,
                    chat_template: str | None = None) -> Path:
    """A LlamaForCausalLM folder (hidden 64, 2 layers, fp32 safetensors) with its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    make_hf_tokenizer(out, texts, vocab_size=400)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if chat_template is not None:
        tok.chat_template = chat_template
        tok.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out
