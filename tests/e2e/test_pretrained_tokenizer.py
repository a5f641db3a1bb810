"""A from-scratch Llama on a pretrained tokenizer (data.tokenizer=DIR), end to end and offline: a
byte-level BPE trained here and saved as a transformers PreTrainedTokenizerFast folder, its
special tokens at ids of its own (not 0/1/2). Two CPU workers train on the stdlib email package;
the token cache holds the tokenizer's own encoding; model/ and the snapshots carry its files
byte for byte; load_model, `paratrain generate` and the Hugging Face export use it; a different
tokenizer builds a new cache and the same one reuses it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from paratrain.data import load_prepared
from tests.conftest import (
    cli_run,
    corpus_texts,
    make_hf_tokenizer,
    read_metrics,
    run_cli,
    tiny_overrides,
)

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, corpus_dir) -> tuple[Path, Path]:
    """(Llama-like <s>/</s>, GPT-2-like <|endoftext|> alone), both trained on the corpus."""
    tmp = tmp_path_factory.mktemp("tokenizers")
    texts = corpus_texts(corpus_dir)
    return (make_hf_tokenizer(tmp / "llama_like", texts, 384),
            make_hf_tokenizer(tmp / "gpt2_like", texts, 320, bos=False))


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus_dir, tokenizers):
    tmp = tmp_path_factory.mktemp("pretrained-tok")
    cache = tmp / "cache"
    r = run_cli(["train"] + tiny_overrides(corpus_dir, cache, **{
        "data.tokenizer": str(tokenizers[0]), "trainer.devices": "cpu:2",
        "trainer.max_steps": 30, "checkpoint.every_steps": 15, "run.dir": str(tmp / "run")}),
        cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run", cache, r


def _caches(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "data").iterdir() if (p / "meta.json").is_file())


def test_trains_and_the_cache_holds_the_tokenizers_encoding(run, tokenizers, corpus_dir):
    run_dir, cache, r = run
    hf = transformers.AutoTokenizer.from_pretrained(tokenizers[0], local_files_only=True)
    assert hf.eos_token_id >= 384  # its own ids, not [PAD]/[BOT]/[EOT]'s 0/1/2
    losses = [m["loss"] for m in read_metrics(run_dir)]
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5])
    config = json.loads((run_dir / "model" / "config.json").read_text())
    assert config["vocab_size"] == len(hf)
    [prepared] = _caches(cache)
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["tokenizer"] == "pretrained" and meta["eot_id"] == hf.eos_token_id
    texts = set(corpus_texts(corpus_dir))
    seen = 0
    for split in ("train", "val"):
        tokens = load_prepared(prepared).tokens(split)[:]
        offsets = np.load(prepared / f"{split}_offsets.npy")
        for a, b in zip(offsets[:-1], offsets[1:]):
            ids = tokens[a:b].tolist()
            assert ids[-1] == hf.eos_token_id
            text = hf.decode(ids[:-1])
            assert text in texts and ids[:-1] == hf(text, add_special_tokens=False)["input_ids"]
            seen += 1
    assert seen == len(texts)


def test_model_dir_and_snapshots_carry_the_tokenizer_unchanged(run, tokenizers, tmp_path,
                                                               capsys):
    run_dir, _, _ = run
    files = sorted(p.name for p in tokenizers[0].iterdir())
    assert "tokenizer_config.json" in files
    snapshot = run_dir / "checkpoints" / "step-0000015"
    for folder in (run_dir / "model", snapshot):
        for name in files:
            assert (folder / name).read_bytes() == (tokenizers[0] / name).read_bytes(), name
    r = cli_run(capsys, ["checkpoint", "export", str(snapshot), str(tmp_path / "exported")])
    assert r.returncode == 0, r.stderr[-2000:]
    for name in files:
        assert (tmp_path / "exported" / name).read_bytes() == (tokenizers[0] / name).read_bytes()


def test_load_model_and_generate_use_the_pretrained_tokenizer(run, tokenizers, capsys):
    from paratrain.models.files import load_model
    run_dir, _, _ = run
    hf = transformers.AutoTokenizer.from_pretrained(tokenizers[0], local_files_only=True)
    model, tok = load_model(run_dir)
    assert tok.kind == "pretrained" and (tok.bot_id, tok.eot_id) == (hf.bos_token_id,
                                                                     hf.eos_token_id)
    prompt = "def get_payload(self"
    assert tok.encode(prompt) == hf(prompt, add_special_tokens=False)["input_ids"]
    g = cli_run(capsys, ["generate", str(run_dir), "--prompt", prompt, "--max-new-tokens", "20",
                         "--device", "cpu"])
    assert g.returncode == 0 and g.stdout.startswith(prompt), g.stderr[-2000:]
    assert len(g.stdout) > len(prompt) + 5


def test_hf_export_keeps_the_tokenizer_and_matches_logits(run, tokenizers, tmp_path, capsys):
    from paratrain.models.files import load_model
    run_dir, _, _ = run
    out = tmp_path / "hf"
    r = cli_run(capsys, ["checkpoint", "export", str(run_dir), str(out), "--format", "hf"])
    assert r.returncode == 0, r.stderr[-2000:]
    for p in tokenizers[0].iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    hf = transformers.LlamaForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (hf_tok.bos_token_id,
                                                                hf_tok.eos_token_id)
    ours, _ = load_model(run_dir)
    ids = torch.tensor([hf_tok("from email import message", add_special_tokens=False)
                        ["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids), atol=1e-4)


def test_a_changed_tokenizer_builds_a_new_cache_and_the_same_one_reuses(run, tokenizers,
                                                                        corpus_dir):
    run_dir, cache, _ = run
    before = _caches(cache)
    common = {"data.format": "padded", "trainer.devices": "cpu:1", "trainer.max_steps": 3}
    r = run_cli(["train"] + tiny_overrides(corpus_dir, cache, **common, **{
        "data.tokenizer": str(tokenizers[1]), "run.dir": str(run_dir.parent / "gpt2")}),
        cwd=run_dir.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data: reusing" not in r.stdout + r.stderr
    after = _caches(cache)
    [new] = sorted(set(after) - set(before))
    meta = json.loads((new / "meta.json").read_text())
    hf = transformers.AutoTokenizer.from_pretrained(tokenizers[1], local_files_only=True)
    assert meta["bot_id"] == meta["eot_id"] == meta["pad_id"] == hf.eos_token_id
    r = run_cli(["train"] + tiny_overrides(corpus_dir, cache, **common, **{
        "data.tokenizer": str(tokenizers[0]), "run.dir": str(run_dir.parent / "again")}),
        cwd=run_dir.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"data: reusing {before[0]}" in r.stdout + r.stderr
    assert _caches(cache) == after
