"""A tiny local "pretrained" Hugging Face Llama and input->output pairs, made offline in a second:
the model folder a new user would point model.path at (config, random weights, a byte-level BPE
tokenizer trained on the pairs), for tests that run fine-tuning as a user does."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import make_hf_llama


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
    return make_hf_llama(out, texts, vocab_size=400, max_positions=max_positions, seed=seed,
                         chat_template=chat_template)
